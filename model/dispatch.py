"""The MoE dispatcher seam: how routed tokens reach expert compute and come back.

`LatentMoE` calls `dispatch(x, topk_idx, topk_weight)` and `combine(y, handle)` on the object it is
given. `LocalDispatcher` (this file) keeps everything on one device; `moonep` provides the
expert-parallel one with the same contract:

- dispatch(x, topk_idx, topk_weight, during=None) -> (x_grouped [R, l] rows grouped by local
  expert, group_sizes [E_local] int64, handle); `during` (a callable, e.g. the shared experts)
  runs while the tokens travel (here: right away) and its result is `handle.during_out`
- the caller runs its grouped GEMM over (x_grouped, group_sizes)
- combine(y_grouped [R, l], handle) -> [S, l] fp32: sum_k topk_weight[s, k] * y of (s, k),
  in the original token order, accumulated in fp32 and deterministic (no atomics).
- expert_weights(handle, experts) -> (w1, w3, w2) with one [out, in] matrix per GEMM group: the
  experts' own weights here; under expert parallelism the local shard plus fetched replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.balancing import count_ids
from model.ops.backends import cpu_run
from model.ops.combine import weighted_combine


def _combine_dtype(topk_weight: torch.Tensor) -> torch.Tensor:
    """The routing weights in the combine's accumulation dtype: at least fp32."""
    return topk_weight.to(torch.promote_types(topk_weight.dtype, torch.float32))


@dataclass
class LocalHandle:
    order: torch.Tensor  # [S*k] position in the flat (token, k) list of each grouped row
    topk_weight: torch.Tensor  # [S, k] fp32
    num_tokens: int
    during_out: object = None


def _pair_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x[order // k]: [S*k, l] token rows in grouped order. On a CPU each token's row is
    repeated k times in (token, k) order and then permuted with index_select: autograd's
    backward is an index_add over a permutation and a sum over k (deterministic), where
    x[order // k]'s is an accumulating index_put, ~20x slower on a CPU (on CUDA a sort-based
    kernel; kept there, as the roofline and GPU figures have it)."""
    if not cpu_run(x.device):
        return x[order // k]
    S, d = x.shape
    return x.unsqueeze(1).expand(S, k, d).reshape(S * k, d).index_select(0, order)


class LocalDispatcher:
    """Sort (token, expert) pairs by expert; no communication."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 during=None) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        S, k = topk_idx.shape
        flat = topk_idx.reshape(-1)  # [S*k]
        order = torch.argsort(flat, stable=True)  # [S*k] grouped by expert, token order inside
        x_grouped = _pair_rows(x, order, k)  # [S*k, l]
        group_sizes = count_ids(flat, self.num_experts)  # [E] (no host sync, unlike bincount)
        during_out = during() if during is not None else None
        return x_grouped, group_sizes, LocalHandle(order, _combine_dtype(topk_weight), S,
                                                   during_out)

    def expert_weights(self, handle: LocalHandle, experts: torch.nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return experts.w1, experts.w3, experts.w2

    def combine(self, y: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        # [S, l] in the weights' dtype: fp32 (fp64 in the float64 verification mode)
        return weighted_combine(y, handle.order, handle.topk_weight)

"""Stable LatentMoE (k3-architecture.md §4.2) with the fp32 sigmoid router and Quantile Balancing.

router (fp32 sigmoid; bias only selects) -> latent down-projection -> dispatcher -> grouped
SiTU-GLU experts in the latent width -> fp32 combine -> RMSNorm -> up-projection, plus the shared
experts fused into one full-width MLP. Expert parallelism plugs in by swapping `dispatcher`; the
shared experts run as the dispatcher's `during` work, so under expert parallelism their GEMMs
(compute stream) overlap the token all-to-all (NCCL stream); nothing else changes order.
The router records Quantile-Balancing histograms in training forwards (not in activation-
checkpoint recomputation) through the custom op `k3::record_router_stats`, so a layer stays one
torch.compile graph; `apply_quantile_balancing()` is called between optimizer steps.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from model.balancing import (
    expert_loads,
    margin_histogram,
    quantile_balance_update_from_histogram,
)
from model.config import ModelConfig
from model.dispatch import LocalDispatcher
from model.linear import Linear
from model.mlp import SiTUMLP
from model.norms import RMSNorm
from model.ops.backends import triton_chosen
from model.ops.grouped_gemm import grouped_mm
from model.ops.situ import situ_glu

_STATS_ENV = "K3_ROUTER_STATS_BACKEND"  # auto | torch | triton (model.ops.backends)


def in_recomputation() -> bool:
    """True while autograd runs a backward pass (e.g. activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("k3::record_router_stats", mutates_args=("qb_counts", "expert_load"))
def record_router_stats(qb_counts: torch.Tensor, expert_load: torch.Tensor,
                        scores: torch.Tensor, bias: torch.Tensor, topk_idx: torch.Tensor,
                        top_k: int) -> None:
    """qb_counts [E, bins] += the margin histogram of `scores` [S, E] (detached) under `bias`;
    expert_load [E] += the tokens routed to each expert (`topk_idx` [S, k]); tokens with a
    non-finite score count in neither (the trainer skips such a step); nothing while
    autograd runs a backward pass (activation-checkpoint recompute must not count twice).

    A custom op so that the check runs when the op runs, not when torch.compile traces the layer:
    one opaque node (no graph break on `in_recomputation()`), right whether the layer is
    recomputed eagerly, by a compiled checkpoint, or not at all. Integer scatter-adds into the
    fixed-size buffers: no host read. On CUDA (`K3_ROUTER_STATS_BACKEND=auto|torch|triton`) one
    Triton kernel does it all (`model.ops.router_stats_triton`); the PyTorch form is the CPU
    path and the oracle."""
    if in_recomputation():
        return
    if triton_chosen(scores, _STATS_ENV):  # one kernel (model.ops.router_stats_triton)
        from model.ops import router_stats_triton

        router_stats_triton.router_stats(qb_counts, expert_load, scores, bias.to(scores.dtype),
                                         topk_idx)
        return
    qb_counts += margin_histogram(scores, bias, top_k, qb_counts.shape[1])
    expert_load += expert_loads(topk_idx, expert_load.shape[0], scores)


@record_router_stats.register_fake
def _(qb_counts, expert_load, scores, bias, topk_idx, top_k) -> None:
    return None


class Router(nn.Module):
    """s = sigmoid(x W^T) in fp32; top-k of s + bias; weights = renormalised s * scaling."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        E = cfg.num_experts
        self.top_k, self.num_bins = cfg.num_experts_per_token, cfg.qb_num_bins
        self.renormalize, self.scaling = cfg.moe_renormalize, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, device=device))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, device=device))
        self.register_buffer("qb_counts", torch.zeros(E, cfg.qb_num_bins, dtype=torch.long,
                                                      device=device))
        self.register_buffer("expert_load", torch.zeros(E, dtype=torch.long, device=device))
        self.record_stats = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, d] -> (topk_idx [S, k] int64, topk_weight [S, k] fp32)."""
        compute = torch.promote_types(x.dtype, torch.float32)
        scores = torch.sigmoid(F.linear(x.to(compute), self.weight.to(compute)))  # [S, E]
        bias = self.e_score_correction_bias.to(compute)
        topk_idx = torch.topk(scores.detach() + bias, self.top_k, dim=-1).indices  # [S, k]
        w = scores.gather(-1, topk_idx)  # [S, k] unbiased scores carry the gradient
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if self.training and self.record_stats:  # skipped inside backward (AC recompute)
            record_router_stats(self.qb_counts, self.expert_load, scores.detach(), bias,
                                topk_idx, self.top_k)
        return topk_idx, w * self.scaling

    def apply_quantile_balancing(self) -> None:
        """Set the bias from this step's pooled histogram (possibly all-reduced), clear counts."""
        apply_quantile_balancing([self])


@torch.no_grad()
def apply_quantile_balancing(routers: list[Router]) -> None:
    """Between optimizer steps: every router's bias from its pooled histogram, counts cleared.
    Routers of one shape (all of a model's) are updated as one batch: ~50 kernels for all the
    layers instead of ~40 per layer, each bias exactly what its own update gives."""
    groups: dict[tuple, list[Router]] = {}
    for r in routers:
        key = (tuple(r.qb_counts.shape), r.top_k, r.e_score_correction_bias.dtype)
        groups.setdefault(key, []).append(r)
    for (_, top_k, _), rs in groups.items():
        biases = [r.e_score_correction_bias for r in rs]
        new = quantile_balance_update_from_histogram(
            torch.stack([r.qb_counts for r in rs]), torch.stack(biases), top_k)
        torch._foreach_copy_(biases, list(new.unbind(0)))
        torch._foreach_zero_([r.qb_counts for r in rs])


class RoutedExperts(nn.Module):
    """E SiTU-GLU experts in the latent width; weights stacked [E, out, in] (w1 gate, w3 up)."""

    def __init__(self, num_experts: int, latent: int, intermediate: int, beta: float,
                 linear_beta: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gemm = grouped_mm  # `model.precision.apply_mxfp8` swaps in the MXFP8 grouped GEMM
        # (w1, w3, w2) gradient buffers while `parallel.grad_accumulation` fuses accumulation
        self.main_grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, latent, device=device))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, latent, device=device))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, intermediate, device=device))

    @property
    def fuses_wgrad(self) -> bool:
        """Whether the expert GEMMs have a fused weight-gradient form (the grouped GEMM's
        `main_grad=`; the MXFP8 grouped GEMM has none)."""
        return self.gemm is grouped_mm

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                dispatcher, during=None) -> tuple[torch.Tensor, object]:
        """Latent tokens x [S, l] and their routing -> (the fp32 weighted expert sum [S, l],
        the result of `during`, run while the dispatch is in flight).

        Dispatch, the expert weights (with expert parallelism: home experts plus replicas
        fetched from their owners), the grouped GEMMs and the combine all run inside this one
        module call, so a wrapper that gathers the parameters around `forward` (FSDP over the
        expert-data-parallel ranks) sees every use of them, and in backward the gradients that
        replicas send home arrive before the gradient of `x` leaves the module."""
        x_grouped, group_sizes, handle = dispatcher.dispatch(x, topk_idx, topk_weight,
                                                             during=during)
        weights = dispatcher.expert_weights(handle, self)
        y_grouped = self.grouped(x_grouped, group_sizes, weights)  # [R, l]
        return dispatcher.combine(y_grouped, handle), handle.during_out

    def grouped(self, x: torch.Tensor, group_sizes: torch.Tensor,
                weights: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """x [R, l] rows grouped by GEMM group; group_sizes [G] -> [R, l].

        `weights` = (w1, w3, w2) per group when they are not this module's own [E, ...] stacks
        (expert parallelism: local experts plus replicas, see `model.dispatch`)."""
        w1, w3, w2 = weights if weights is not None else (self.w1, self.w3, self.w2)
        m1 = m3 = m2 = None
        if self.main_grads is not None and self.fuses_wgrad and w1 is self.w1:
            m1, m3, m2 = self.main_grads  # own stacks: their gradients add into these
        h = situ_glu(self._gemm(x, w1, group_sizes, m1), self._gemm(x, w3, group_sizes, m3),
                     self.beta, self.linear_beta)  # [R, m]
        return self._gemm(h, w2, group_sizes, m2)

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor,
              main_grad: torch.Tensor | None) -> torch.Tensor:
        if main_grad is None:
            return self.gemm(x, w, group_sizes)
        return grouped_mm(x, w, group_sizes, main_grad=main_grad)


class LatentMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        d, latent = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = Router(cfg, device)
        self.routed_expert_down_proj = Linear(d, latent, bias=False, device=device)
        self.experts = RoutedExperts(cfg.num_experts, latent, cfg.moe_intermediate_size,
                                     cfg.activation_situ_beta, cfg.activation_situ_linear_beta,
                                     device)
        self.routed_expert_norm = (RMSNorm(latent, cfg.rms_norm_eps, device)
                                   if cfg.latent_moe_use_norm else None)
        self.routed_expert_up_proj = Linear(latent, d, bias=False, device=device)
        self.shared_experts = (
            SiTUMLP(d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                    cfg.activation_situ_beta, cfg.activation_situ_linear_beta, device)
            if cfg.num_shared_experts > 0 else None)
        self.dispatcher = LocalDispatcher(cfg.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xs = x.reshape(-1, shape[-1])  # [S, d]
        topk_idx, topk_weight = self.gate(xs)
        x_latent = self.routed_expert_down_proj(xs)  # [S, l]
        shared = (None if self.shared_experts is None
                  else functools.partial(self.shared_experts, xs))
        u, y_shared = self.experts(x_latent, topk_idx, topk_weight, self.dispatcher,
                                   during=shared)  # [S, l] fp32, [S, d]
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u.to(x.dtype))
        if y_shared is not None:
            y = y + y_shared
        return y.view(shape)

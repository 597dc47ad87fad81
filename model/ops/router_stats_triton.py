"""Triton kernel of the router's Quantile-Balancing statistics (`model.moe.record_router_stats`).

One program per block of tokens reads its [tokens, experts] fp32 scores, the bias and the
selected experts once and adds, with integer atomics into one int32 scratch buffer, the margin
histogram (`model.balancing.margin_histogram`) and the per-expert token counts
(`expert_loads`); two adds then fold the scratch into the int64 buffers. What eager PyTorch does
in ~24 kernels per layer (a second top-k, the margins, the bounds, floor/clamp, the finite
checks, two scatter-adds) is 4 kernels. The cutoff alpha (the (k+1)-th largest biased score) is
the largest biased score among the experts not selected: the router's top-k gives it without a
second top-k. The bin arithmetic is the reference's, in fp32 with IEEE division (`div_rn`), so
a margin lands in the same bin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BOUND_EPS = 1e-4  # model.balancing._BOUND_EPS


@triton.jit
def _router_stats_kernel(s_ptr, b_ptr, idx_ptr, out_ptr, S, E, NUM_BINS: tl.constexpr,
                         TOP_K: tl.constexpr, EPS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_E: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < S
    col_ok = cols < E
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    lo = (-1.0 - tl.max(tl.where(col_ok, b, float("-inf")), axis=0)) - EPS
    hi = (1.0 - tl.min(tl.where(col_ok, b, float("inf")), axis=0)) + EPS
    width = tl.math.div_rn(hi - lo, NUM_BINS * 1.0)
    valid = row_ok[:, None] & col_ok[None, :]
    s = tl.load(s_ptr + rows[:, None] * E + cols[None, :], mask=valid, other=0.0)
    selected = tl.zeros((BLOCK_S, BLOCK_E), dtype=tl.int1)
    for j in tl.static_range(TOP_K):
        e = tl.load(idx_ptr + rows * TOP_K + j, mask=row_ok, other=0)
        selected = selected | (cols[None, :] == e[:, None])
    alpha = tl.max(tl.where(valid & ~selected, s + b[None, :], float("-inf")), axis=1)
    r = s - alpha[:, None]
    bad_r = (r != r) | (tl.abs(r) == float("inf"))
    bad_s = (s != s) | (tl.abs(s) == float("inf"))
    ok_r = tl.sum((bad_r & valid).to(tl.int32), axis=1) == 0
    ok_s = tl.sum((bad_s & valid).to(tl.int32), axis=1) == 0
    r = tl.where(ok_r[:, None] & valid, r, lo)
    q = tl.floor(tl.math.div_rn(r - lo, width))
    bins = tl.minimum(tl.maximum(q, 0.0), NUM_BINS - 1.0).to(tl.int64)
    flat = tl.where(valid, cols[None, :] * NUM_BINS + bins, 0)
    tl.atomic_add(out_ptr + flat, tl.full((BLOCK_S, BLOCK_E), 1, tl.int32),
                  mask=valid & ok_r[:, None])
    loads = out_ptr + E * NUM_BINS
    for j in tl.static_range(TOP_K):
        e = tl.load(idx_ptr + rows * TOP_K + j, mask=row_ok, other=0)
        tl.atomic_add(loads + e, tl.full((BLOCK_S,), 1, tl.int32), mask=row_ok & ok_s)


def router_stats(qb_counts: Tensor, expert_load: Tensor, scores: Tensor, bias: Tensor,
                 topk_idx: Tensor) -> None:
    """qb_counts [E, bins] int64 += the margin histogram, expert_load [E] int64 += the tokens
    per expert (finite rows only); scores [S, E] and bias [E] fp32, topk_idx [S, k]."""
    S, E = scores.shape
    bins, k = qb_counts.shape[1], topk_idx.shape[1]
    scratch = torch.zeros(E * bins + E, dtype=torch.int32, device=scores.device)
    if S:
        block_e = triton.next_power_of_2(E)
        block_s = max(1, min(64, 4096 // block_e))
        _router_stats_kernel[(triton.cdiv(S, block_s),)](
            scores.contiguous(), bias.contiguous(), topk_idx.contiguous(), scratch, S, E,
            NUM_BINS=bins, TOP_K=k, EPS=_BOUND_EPS, BLOCK_S=block_s, BLOCK_E=block_e)
    qb_counts += scratch[:E * bins].view(E, bins)
    expert_load += scratch[E * bins:]

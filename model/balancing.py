"""Quantile Balancing (QB): the K3 aux-loss-free MoE load-balancing bias update.

Routing picks ``topk(scores + bias)``; the mixture weights use the unbiased scores. Once per step,
QB replaces the whole bias (design spec section 4.4)::

    alpha_i = (k+1)-th largest of (s_i + b)       r_ij = s_ij - alpha_i
    b_hat_j = -[(q+1)-th largest of r_:j]         b_new = b_hat - mean(b_hat),   q = m*k/n

Two estimators:

* ``quantile_balance_update``: exact, from all ``[m, n]`` scores of one device (tests, reference).
* ``margin_histogram`` + ``quantile_balance_update_from_histogram``: per micro-batch, int64 counts
  of the margins in ``num_bins`` fixed bins per expert. Counts from micro-batches and ranks add
  up exactly (the bounds depend only on the bias, which every rank shares), and the quantile is
  read from the pooled histogram with linear interpolation inside a bin (error <= one bin width).

Deliberately NOT here: buffers, collectives (no ``torch.distributed``; the caller all-reduces the
counts), EMA, activation-checkpoint bookkeeping, and the router itself. All maths is fp32 (or
fp64 when given fp64). Nothing on the hot path reads tensor data on the host (counts are
scatter-adds into fixed-size buffers, not ``bincount``), so no GPU sync.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "count_ids",
    "expert_loads",
    "margin_bounds",
    "margin_histogram",
    "quantile_balance_update",
    "quantile_balance_update_from_histogram",
]

_BOUND_EPS = 1e-4  # widening of [lo, hi]; margins are clamped into range anyway


def _check(scores: Tensor, bias: Tensor, topk: int) -> None:
    if scores.dim() != 2 or bias.shape != (scores.shape[1],):
        raise ValueError(f"expected scores [m, n] and bias [n], got {scores.shape}, {bias.shape}")
    n = scores.shape[1]
    if not 1 <= topk < n:
        raise ValueError(
            f"quantile balancing needs 1 <= topk < num_experts (the cutoff is the (k+1)-th "
            f"largest biased score); got topk={topk}, num_experts={n}"
        )


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _margins(scores: Tensor, bias: Tensor, topk: int) -> Tensor:
    """r_ij = s_ij - alpha_i with alpha_i the (k+1)-th largest of s_i + b. Shape [m, n]."""
    _check(scores, bias, topk)
    dt = _compute_dtype(scores)
    s, b = scores.to(dt), bias.to(dt)
    alpha = torch.topk(s + b, topk + 1, dim=1, sorted=True).values[:, topk]
    return s - alpha[:, None]


def quantile_balance_update(scores: Tensor, bias: Tensor, topk: int) -> Tensor:
    """Exact QB update from unbiased sigmoid scores ``[m, n]`` and the routing bias ``[n]``.

    Uses the integer rank q = round(m*k/n) (half up), clipped to [0, m-1]. Returns the new,
    mean-zero bias ``[n]`` in the compute dtype (fp32, or fp64 for fp64 input).
    """
    r = _margins(scores, bias, topk)
    m, n = r.shape
    if m == 0:
        return bias.to(r.dtype).clone()
    q = min(max(math.floor(m * topk / n + 0.5), 0), m - 1)
    b_hat = -torch.topk(r, q + 1, dim=0, sorted=True).values[q]
    return b_hat - b_hat.mean()


def _bounds(bias: Tensor) -> tuple[Tensor, Tensor]:
    """lo, hi (bias [..., n] -> [...]; 0-d for one bias) with lo < every margin < hi, for
    scores in (0, 1)."""
    b = bias.to(_compute_dtype(bias))
    return -1.0 - b.amax(-1) - _BOUND_EPS, 1.0 - b.amin(-1) + _BOUND_EPS


def margin_bounds(bias: Tensor) -> tuple[float, float]:
    """Bounds [lo, hi] containing every margin: alpha in [min b, 1 + max b] and s in (0, 1)."""
    lo, hi = _bounds(bias)
    return float(lo), float(hi)


def margin_histogram(scores: Tensor, bias: Tensor, topk: int, num_bins: int = 1000) -> Tensor:
    """Per-expert int64 histogram ``[n, num_bins]`` of the margins of one micro-batch.

    Bin b covers [lo + b*w, lo + (b+1)*w) with (lo, hi) = margin_bounds(bias), w = (hi-lo)/B.
    Deterministic, and additive over any split of the tokens for a fixed bias.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    r = _margins(scores, bias, topk)
    n = r.shape[1]
    lo, hi = _bounds(bias)
    width = (hi - lo) / num_bins
    # a token with a non-finite score (a NaN step, skipped by the trainer) is not counted
    ok = torch.isfinite(r).all(dim=1, keepdim=True)
    r = torch.where(ok, r, lo.to(r.dtype))
    idx = torch.floor((r - lo) / width).clamp_(0, num_bins - 1).long()
    idx += torch.arange(n, device=r.device) * num_bins  # flat index expert*B + bin
    return count_ids(idx.flatten(), n * num_bins, ok.expand_as(idx).flatten()).view(n, num_bins)


def _histogram_quantile(counts: Tensor, bias: Tensor, topk: int) -> Tensor:
    """Per expert, v with (interpolated) #margins > v equal to q = m*k/n. counts [..., n, B],
    bias [..., n] (leading dims: independent routers) -> [..., n], fp64."""
    n, num_bins = counts.shape[-2:]
    if bias.shape != counts.shape[:-1] or not 1 <= topk < n:
        raise ValueError(f"bad shapes/topk: counts {counts.shape}, bias {bias.shape}, k={topk}")
    c = counts.to(torch.int64)
    m = c[..., 0, :].sum(-1)
    q = (m.double() * topk / n)[..., None]  # [..., 1]
    # above[..., b] = number of margins in bins >= b, for b in 0..B (above[..., B] = 0).
    above = torch.cat([c.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(c[..., :1])], dim=-1)
    # Bin holding the q-th largest: the last b with above[b] >= q (and > 0, so q == 0 picks the
    # top non-empty bin). `above` is non-increasing, so the mask is a prefix and its length - 1
    # is the index.
    ok = (above[..., :num_bins].double() >= q[..., None]) & (above[..., :num_bins] > 0)
    b = (ok.sum(-1) - 1).clamp_(min=0)
    lo, hi = _bounds(bias)
    lo, width = lo.double()[..., None], ((hi - lo).double() / num_bins)[..., None]
    in_bin = c.gather(-1, b[..., None]).squeeze(-1).double().clamp(min=1.0)
    above_next = above.gather(-1, (b + 1)[..., None]).squeeze(-1).double()
    return lo + (b + 1).double() * width - (q - above_next) / in_bin * width


def quantile_balance_update_from_histogram(counts: Tensor, bias: Tensor, topk: int) -> Tensor:
    """QB update from pooled margin histograms ``[n, B]`` built with this same ``bias`` ``[n]``;
    or ``[L, n, B]`` and ``[L, n]``: L routers of one shape updated at once, each row exactly
    as alone (one set of kernels for all of them, not one per layer).

    m = counts[0].sum() and the real-valued rank q = m*k/n is interpolated (no rounding).
    An empty histogram (m == 0) returns the old bias unchanged. Output dtype follows ``bias``
    (fp32 or fp64).
    """
    v = _histogram_quantile(counts, bias, topk)
    b_hat = -v
    new = (b_hat - b_hat.mean(-1, keepdim=True)).to(_compute_dtype(bias))
    old = bias.to(new.dtype)
    return torch.where(counts[..., 0, :].sum(-1, keepdim=True) > 0, new, old)


def count_ids(ids: Tensor, n: int, keep: Tensor | None = None) -> Tensor:
    """int64 ``[n]``: how often each of 0..n-1 occurs in ``ids`` (ids must lie in [0, n)),
    counting only where the bool mask ``keep`` (ids' shape) is true, if given.

    A scatter-add into a fixed-size buffer: unlike ``torch.bincount``, whose output size
    depends on ``ids.max()``, it never reads data back to the host (no GPU sync), and integer
    adds make it deterministic."""
    flat = ids.reshape(-1).long()
    ones = torch.ones_like(flat) if keep is None else keep.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, ones)


def expert_loads(topk_idx: Tensor, n: int, scores: Tensor | None = None) -> Tensor:
    """Tokens routed to each expert: int64 ``[n]`` from selected expert ids ``[m, k]``; with
    their ``scores`` [m, n], tokens with a non-finite score are not counted."""
    if scores is None:
        return count_ids(topk_idx, n)
    keep = torch.isfinite(scores).all(dim=1, keepdim=True).expand_as(topk_idx)
    return count_ids(topk_idx, n, keep)

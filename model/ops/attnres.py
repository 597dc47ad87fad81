"""Block Attention-Residual mixing op (k3-architecture.md §3.3).

Softmax attention over depth: each source is a hidden state; its key is the source RMS-normalised
(no weight); the query is one learned vector per mix (norm weight folded into the pseudo-query).
The raw (un-normalised) sources are mixed. All maths in fp32; result in the sources' dtype.
This op holds no parameters; `model.attnres.AttnResMix` owns them.
"""

from __future__ import annotations

import torch


def attnres_mix(sources: torch.Tensor, query: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Mix `sources` [N, ..., d] (snapshots first, running prefix last) with `query` [d].

    Returns [..., d]: sum_n softmax_n(<rmsnorm(sources_n), query>) * sources_n.
    """
    compute = torch.promote_types(sources.dtype, torch.float32)
    v = sources.to(compute)  # [N, ..., d]
    khat = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # [N, ..., d]
    logits = (khat * query.to(compute)).sum(-1)  # [N, ...]
    p = torch.softmax(logits, dim=0)  # [N, ...]
    out = (p.unsqueeze(-1) * v).sum(0)  # [..., d]
    return out.to(sources.dtype)


def attnres_weights(sources: torch.Tensor, query: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The depth-softmax weights [N, ...] of `attnres_mix` (for metrics and heatmaps)."""
    compute = torch.promote_types(sources.dtype, torch.float32)
    v = sources.to(compute)
    khat = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return torch.softmax((khat * query.to(compute)).sum(-1), dim=0)

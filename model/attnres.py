"""Block AttnRes parameters (k3-architecture.md §3.3): one norm + one zero-initialised pseudo-query.

K3 names them `<site>_res_norm` (RMSNorm weight [d]) and `<site>_res_proj` (Linear d->1). The mix
runs `model.ops.attnres_mix` in fp32 over the snapshots `blocks` and then the running prefix,
read in place; the metrics' depth weights fold the norm weight into the query and use the
reference formula over `cat(blocks, prefix[None])`.
"""

from __future__ import annotations

import torch
from torch import nn

from model.ops.attnres import attnres_mix, attnres_weights


def attnres_query(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """[d] pseudo-query = norm.weight * proj.weight[0]."""
    compute = torch.promote_types(norm_weight.dtype, torch.float32)
    return norm_weight.to(compute) * proj_weight[0].to(compute)


def mix(prefix: torch.Tensor, blocks: torch.Tensor, norm: nn.Module, proj: nn.Linear,
        eps: float) -> torch.Tensor:
    """prefix [B, T, d], blocks [n, B, T, d] -> mixed [B, T, d]."""
    return attnres_mix(blocks, prefix, norm.weight, proj.weight[0], eps)


def mix_weights(prefix: torch.Tensor, blocks: torch.Tensor, norm: nn.Module, proj: nn.Linear,
                eps: float) -> torch.Tensor:
    """The depth weights [n+1, B, T] the mix would use (for metrics)."""
    sources = torch.cat([blocks, prefix.unsqueeze(0)], dim=0)
    return attnres_weights(sources, attnres_query(norm.weight, proj.weight), eps)

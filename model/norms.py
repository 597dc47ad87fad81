"""Normalisation layers used across K3: RMSNorm and gated RMSNorm (KDA output).

KDA's per-head q/k L2 norm is part of its op (`model.ops.kda.kda_prologue`).

The row maths is `model.ops.rms_norm` (our Triton kernels on CUDA, the reference formulas
elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from model.ops.rms_norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-5, device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(RMSNorm):
    """KDA output norm: RMSNorm over each head's channels, times sigmoid(gate).

    fla's FusedRMSNormGated with activation='sigmoid'; one weight [D] shared by all heads."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return gated_rms_norm(x, self.weight, gate, self.eps)


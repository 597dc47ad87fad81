"""SiTU-GLU MLP: K3's dense first layer and its fused shared experts (k3-architecture.md §4.2)."""

from __future__ import annotations

import torch
from torch import nn

from model.linear import Linear
from model.ops.situ import situ_glu


class SiTUMLP(nn.Module):
    """down( SiTU(gate(x)) * softcap(up(x)) ); names match K3's gate/up/down_proj."""

    def __init__(self, dim: int, intermediate: int, beta: float = 4.0, linear_beta: float = 25.0,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = Linear(dim, intermediate, bias=False, device=device)
        self.up_proj = Linear(dim, intermediate, bias=False, device=device)
        self.down_proj = Linear(intermediate, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta)
        return self.down_proj(h)

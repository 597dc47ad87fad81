"""SiTU-GLU (k3-architecture.md §4.3): bounded GLU activation used by every K3 MLP.

SiTU(g) = b1*tanh(g/b1)*sigmoid(g);  softcap(u) = b2*tanh(u/b2);  out = SiTU(gate) * softcap(up).
|out| < b1*b2 (= 100 for K3). Computed in fp32 and cast back to the input dtype. Autograd comes
from the elementwise ops themselves (no hand-written backward to get wrong).
"""

from __future__ import annotations

import torch

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """SiTU(gate) * softcap(up), elementwise, fp32 inside (float64 stays float64)."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(compute)
    u = up.to(compute)
    situ = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    capped = linear_beta * torch.tanh(u / linear_beta)
    return (situ * capped).to(gate.dtype)

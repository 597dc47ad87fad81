"""Causal depthwise short convolution + SiLU (KDA's q/k/v convs), resetting at document starts.

y_t = silu( sum_s w[K-1-s] * x_{t-s} ), where taps reaching before the token's document start are
dropped, so a packed batch equals each document alone. Implemented as K shifted multiply-adds
(K = 4): a loop over kernel taps, never over tokens. Weight kept fp32 ([C, 1, K], Conv1d layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device))

    def forward(self, x: torch.Tensor, pos_in_doc: torch.Tensor) -> torch.Tensor:
        """x [B, T, C]; pos_in_doc [B, T] position of each token in its document."""
        T = x.shape[1]
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        w = self.weight.to(compute)[:, 0, :]  # [C, K]
        y = xf * w[:, -1]
        for s in range(1, self.kernel_size):
            shifted = F.pad(xf, (0, 0, s, 0))[:, :T]  # [B, T, C] = x_{t-s}
            keep = (pos_in_doc >= s).unsqueeze(-1).to(compute)  # [B, T, 1]
            y = y + shifted * keep * w[:, -1 - s]
        return F.silu(y).to(x.dtype)

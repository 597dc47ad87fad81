"""Causal depthwise short convolution + SiLU (KDA's q/k/v convs), resetting at document starts.

y_t = silu( sum_s w[K-1-s] * x_{t-s} ), where taps reaching before the token's document start are
dropped, so a packed batch equals each document alone. The maths is `model.ops.short_conv`
(`short_conv_silu`: our Triton kernels on CUDA, K shifted multiply-adds elsewhere). Weight kept
fp32 ([C, 1, K], Conv1d layout, as K3 ships it).
"""

from __future__ import annotations

import torch
from torch import nn

from model.ops.short_conv import short_conv_silu


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device))

    def forward(self, x: torch.Tensor, pos_in_doc: torch.Tensor) -> torch.Tensor:
        """x [B, T, C]; pos_in_doc [B, T] position of each token in its document."""
        return short_conv_silu(x, self.weight[:, 0, :], pos_in_doc)

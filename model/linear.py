"""`Linear`: nn.Linear whose weight gradient can add into an fp32 buffer inside its GEMM.

Every GEMM projection of the model is one (same parameters, state dict and forward as
nn.Linear). While `main_grad` is set (`parallel.grad_accumulation` does it for multi-micro-batch
steps under FSDP2), backward adds the weight gradient into it (`model.ops.wgrad.linear`) and the
weight gets no `.grad`; unset, it is nn.Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from model.ops.wgrad import linear


class Linear(nn.Linear):
    main_grad: torch.Tensor | None = None  # [out, in], fp32 (or the reduce dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return super().forward(x)
        return linear(x, self.weight, self.main_grad)

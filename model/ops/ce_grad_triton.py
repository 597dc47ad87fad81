"""Triton kernel of the cross-entropy logit gradient (`model.ops.ce_grad`).

One program per (row, block of vocabulary columns): it reads the row's log-sum-exp, label and
scale once and its block of fp32 logits, and writes (exp(x - lse) - [col == label]) * scale in
the output dtype. One read and one write of the logits; fp32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096


@triton.jit
def _ce_grad_kernel(x_ptr, lse_ptr, y_ptr, s_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * V + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    y = tl.load(y_ptr + row).to(tl.int64)
    s = tl.load(s_ptr + row)
    p = tl.exp(x - lse) - tl.where(cols == y, 1.0, 0.0)
    tl.store(out_ptr + row * V + cols, (p * s).to(out_ptr.dtype.element_ty), mask=mask)


def ce_grad(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor,
            out_dtype: torch.dtype) -> Tensor:
    """Contiguous logits [n, V]; lse, scale fp32 [n]; labels [n] -> [n, V] `out_dtype`."""
    n, V = logits.shape
    out = torch.empty((n, V), dtype=out_dtype, device=logits.device)
    if n and V:
        _ce_grad_kernel[(n, triton.cdiv(V, _BLOCK))](logits, lse, labels, scale, out, V,
                                                     BLOCK=_BLOCK)
    return out

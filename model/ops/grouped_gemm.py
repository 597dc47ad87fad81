"""Grouped GEMM for expert compute: rows of `x` sorted by group, one weight matrix per group.

Backends (chosen by device and dtype, never by a Python loop over groups):
- "grouped_mm": `torch._grouped_mm` (CPU fp32/bf16, bf16 only when compiled; CUDA bf16 on SM90+).
- "padded_bmm": scatter each group into a padded [G, max_rows, in] batch and run one `bmm`;
  works for every dtype (float64 gradchecks) and device, at the cost of one host sync.
"""

from __future__ import annotations

import os

import torch


def grouped_mm_backend(x: torch.Tensor, w: torch.Tensor) -> str:
    forced = os.environ.get("K3_GROUPED_MM_BACKEND")
    if forced:
        return forced
    if not hasattr(torch, "_grouped_mm"):
        return "padded_bmm"
    if any(n * x.element_size() % 16 for n in w.shape[1:]):  # _grouped_mm needs 16-byte strides
        return "padded_bmm"
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        # under torch.compile the op's shape function accepts bf16 only (as on CUDA)
        if x.dtype == torch.bfloat16 or not torch.compiler.is_compiling():
            return "grouped_mm"
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        if torch.cuda.get_device_capability(x.device)[0] >= 9:
            return "grouped_mm"
    return "padded_bmm"


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e].T.

    x: [S, in] rows sorted by group; w: [G, out, in] (nn.Linear layout per group);
    group_sizes: [G] int, summing to S. Returns [S, out] in x's dtype.
    """
    if grouped_mm_backend(x, w) == "grouped_mm":
        offs = torch.cumsum(group_sizes, 0).to(torch.int32)  # [G] end offsets
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # [S, out]
        if y.requires_grad:  # _grouped_mm's backward rejects stride-0 (expanded) gradients
            y.register_hook(lambda g: g.contiguous())
        return y
    return _padded_bmm(x, w, group_sizes)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    G, S = w.shape[0], x.shape[0]
    sizes = group_sizes.to(torch.long)
    group_of_row = torch.repeat_interleave(torch.arange(G, device=x.device), sizes, output_size=S)
    starts = torch.cumsum(sizes, 0) - sizes  # [G]
    row_in_group = torch.arange(S, device=x.device) - starts[group_of_row]  # [S]
    max_rows = int(sizes.max().item()) if S > 0 else 0
    padded = x.new_zeros(G, max_rows, x.shape[1])  # [G, R, in]
    padded = padded.index_put((group_of_row, row_in_group), x)
    y = torch.bmm(padded, w.transpose(-2, -1))  # [G, R, out]
    return y[group_of_row, row_in_group]  # [S, out]

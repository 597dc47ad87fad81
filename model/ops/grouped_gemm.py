"""Grouped GEMM for expert compute: rows of `x` sorted by group, one weight matrix per group.

Backends (chosen by device and dtype, never by a Python loop over groups):
- "grouped_mm": the custom op `k3::grouped_mm` over `torch._grouped_mm` (CPU fp32/bf16; CUDA
  bf16 on SM90+), with its backward as two more grouped GEMMs (`k3::grouped_mm` for dx,
  `k3::grouped_mm_wgrad` for dw). One opaque node for torch.compile and fake-tensor traces; the
  group offsets stay on the device (no host sync). It is the CUDA choice, and the one taken
  under `model.ops.backends.force_cuda_backends()`.
- "padded_bmm": each group into the padded [G, max_rows, in] batch of `TokenGroups` and one `bmm`;
  works for every dtype (float64 verification runs) and device, at the cost of one host sync
  (`max_rows`). The reference path only: listed in `model.ops.HOST_SYNC_OPS`.
"""

from __future__ import annotations

import os

import torch

from model.ops.backends import compile_constant, cuda_backends_forced
from model.ops.token_groups import TokenGroups


def grouped_mm_backend(x: torch.Tensor, w: torch.Tensor) -> str:
    """"grouped_mm" or "padded_bmm" for x [S, in], w [G, out, in] (`K3_GROUPED_MM_BACKEND`
    overrides). Under torch.compile the choice is made once, when the layer is traced."""
    # _grouped_mm needs 16-byte strides
    aligned = not any(n * x.element_size() % 16 for n in w.shape[1:])
    return _grouped_mm_choice(x.device, x.dtype, aligned, cuda_backends_forced())


@compile_constant
def _grouped_mm_choice(device: torch.device, dtype: torch.dtype, aligned: bool,
                       forced_cuda: bool) -> str:
    """`grouped_mm_backend` from constants. torch.compile calls it while tracing and keeps the
    answer (device, dtype, shapes and forcing are guarded by the caller's inputs; the
    environment is not), so the environment read and the CUDA capability query (a host query
    that dynamo does not constant-fold) stay out of the graph."""
    forced = os.environ.get("K3_GROUPED_MM_BACKEND")
    if forced:
        return forced
    if forced_cuda:
        return "grouped_mm"
    if not hasattr(torch, "_grouped_mm") or not aligned:
        return "padded_bmm"
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return "grouped_mm"
    if device.type == "cuda" and dtype == torch.bfloat16:
        if torch.cuda.get_device_capability(device)[0] >= 9:
            return "grouped_mm"
    return "padded_bmm"


@torch.library.custom_op("k3::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[S, in] x [G, out, in] with int32 end offsets [G] -> [S, out]."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("k3::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per group dy[rows].T @ x[rows]: [S, out], [S, in] -> [G, out, in]."""
    return torch._grouped_mm(dy.t(), x, offs=offs)


@_grouped_mm_wgrad_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy: torch.Tensor):
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()  # _grouped_mm rejects stride-0 (expanded) gradients
    dx = _grouped_mm_op(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_wgrad_op(dy, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor,
               main_grad: torch.Tensor | None = None) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e].T.

    x: [S, in] rows sorted by group; w: [G, out, in] (nn.Linear layout per group);
    group_sizes: [G] int, summing to S. Returns [S, out] in x's dtype. `main_grad` [G, out, in]:
    on the "grouped_mm" backend w's gradient is added into it (`model.ops.wgrad`) and w gets
    none; on "padded_bmm" it is ignored and w gets its gradient as usual.
    """
    if grouped_mm_backend(x, w) == "grouped_mm":
        offs = torch.cumsum(group_sizes, 0).to(torch.int32)  # [G] end offsets, on the device
        if main_grad is not None:
            from model.ops.wgrad import grouped_mm_into

            return grouped_mm_into(x, w, offs, main_grad)
        return _grouped_mm_op(x, w, offs)
    return _padded_bmm(x, w, group_sizes)


def grouped_mm_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group dy[rows].T @ x[rows] -> [G, out, in]; `offs` [G] int32 end offsets."""
    return _grouped_mm_wgrad_op(dy, x, offs)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    groups = TokenGroups(group_sizes, x.shape[0], align=1)
    y = torch.bmm(groups.batched(x), w.transpose(-2, -1))  # [G, R, out]; R read on the host
    return groups.unbatch(y)  # [S, out]

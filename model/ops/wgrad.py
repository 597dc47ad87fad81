"""Weight-gradient GEMMs that add into a wide `main_grad` buffer (gradient-accumulation fusion).

Over N micro-batches a bf16 weight's gradient is otherwise written in bf16 by its GEMM and then
cast into, or added to, an fp32 accumulator by FSDP2: 10 B per parameter per micro-batch and
one kernel per tensor, outside any GEMM. Here the GEMM itself adds into the fp32 buffer
(Megatron's `gradient_accumulation_fusion`): `k3::wgrad_accumulate` for a dense weight (one
cuBLAS GEMM with beta = 1, `torch.addmm(out_dtype=fp32, out=)` on CUDA) and
`k3::grouped_wgrad_accumulate` for the stacked experts (our Triton grouped GEMM on CUDA,
`model.ops.grouped_wgrad_triton`), so the accumulation costs no pass of its own and sums in
fp32 from the first micro-batch. The weight then gets no `.grad`: `parallel.grad_accumulation`
owns the buffers and hands them to FSDP2 as its accumulated gradient.

`linear(x, w, main_grad)` and `grouped_mm_into(x, w, offs, main_grad)` are the model's entry
points; both equal `F.linear` / `k3::grouped_mm` in forward and in the input gradient. The
PyTorch forms (an add of the fp32 product) are the CPU path and the oracle's companion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.ops.backends import cuda_backends_forced, triton_chosen
from model.ops.grouped_gemm import _grouped_mm_op

_GROUPED_ENV = "K3_GROUPED_WGRAD_BACKEND"  # auto | torch | triton (model.ops.backends)


@torch.library.custom_op("k3::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad [out, in] += dy[S, out].T @ x[S, in], accumulated and added in main_grad's
    dtype by the GEMM itself (CUDA: bf16 operands, `torch.addmm(out_dtype=, out=)`; elsewhere
    the operands widened first, the same sums)."""
    if dy.is_cuda or cuda_backends_forced():
        from model.loss import addmm_fp32_out_  # the loss's head gradient uses the same GEMM

        addmm_fp32_out_(main_grad, dy.t(), x)
        return
    wide = main_grad.dtype
    torch.addmm(main_grad, dy.t().to(wide), x.to(wide), out=main_grad)


@wgrad_accumulate.register_fake
def _(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("k3::grouped_wgrad_accumulate", mutates_args=("main_grad",))
def grouped_wgrad_accumulate(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor,
                             offs: torch.Tensor) -> None:
    """main_grad[g] [out, in] += dy[rows of g].T @ x[rows of g] for each group g; `offs` [G]
    int32 end offsets (rows sorted by group, as `k3::grouped_mm`)."""
    if triton_chosen(dy, _GROUPED_ENV):
        from model.ops import grouped_wgrad_triton

        grouped_wgrad_triton.grouped_wgrad_accumulate(main_grad, dy, x, offs)
        return
    wide = main_grad.dtype
    main_grad.add_(torch._grouped_mm(dy.t().to(wide), x.to(wide), offs=offs))


@grouped_wgrad_accumulate.register_fake
def _(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> None:
    return None


class _LinearIntoMainGrad(torch.autograd.Function):
    """y = x @ w.T; backward: dx as F.linear, dw added into main_grad (w gets no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor,  # type: ignore[override]
                main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, main_grad)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, w, main_grad = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            wgrad_accumulate(main_grad, dy.reshape(-1, dy.shape[-1]),
                             x.reshape(-1, x.shape[-1]))
        return dx, None, None


class _GroupedIntoMainGrad(torch.autograd.Function):
    """`k3::grouped_mm` whose weight gradient is added into main_grad [G, out, in]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,  # type: ignore[override]
                main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs, main_grad)
        return _grouped_mm_op(x, w, offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, w, offs, main_grad = ctx.saved_tensors
        dy = dy.contiguous()  # _grouped_mm rejects stride-0 (expanded) gradients
        dx = _grouped_mm_op(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            grouped_wgrad_accumulate(main_grad, dy, x, offs)
        return dx, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w) (no bias); with `main_grad` the weight gradient is added into it."""
    if main_grad is None or not torch.is_grad_enabled():
        return F.linear(x, w)
    return _LinearIntoMainGrad.apply(x, w, main_grad)


def grouped_mm_into(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                    main_grad: torch.Tensor) -> torch.Tensor:
    """`k3::grouped_mm(x, w, offs)`, its weight gradient added into `main_grad`."""
    if not torch.is_grad_enabled():
        return _grouped_mm_op(x, w, offs)
    return _GroupedIntoMainGrad.apply(x, w, offs, main_grad)

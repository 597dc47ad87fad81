"""The MoE combine: expert outputs in grouped order back to tokens, weighted, in fp32.

out[s] = sum_j w[s, j] * y[inverse[s * k + j]], inverse = the permutation undoing `order` (row r
of y belongs to flat (token, k) pair order[r]), accumulated in w's dtype (fp32, or fp64 in the
verification mode), deterministic (no atomics).

* `weighted_combine(y, order, topk_weight)`: what the local dispatcher calls (`model.dispatch`;
  `moonep.dispatch` keeps its own combine: moonep imports nothing from `model/`). With the
  Triton backend (CUDA, 16/32-bit y, or `K3_COMBINE_BACKEND=triton`; and in fake-tensor traces
  under `force_cuda_backends()`) it is the custom op `k3::moe_combine` / `k3::moe_combine_bwd`
  over our kernels (`model.ops.combine_triton`): one gathered read of y and one fp32 write
  forward, instead of a gathered copy, an fp32 copy and a product; backward scatters w * dout
  into y's layout (a permutation: no conflicts) and reduces d w per row. Otherwise it is the
  reference below.
* `weighted_combine_reference`: gather, cast, multiply, sum under autograd (the oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.ops.backends import triton_chosen, use_fused_kernel

_ENV = "K3_COMBINE_BACKEND"


def inverse_order(order: Tensor) -> Tensor:
    """The permutation undoing `order` (inverse[order[r]] = r), on order's device."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inverse


def weighted_combine_reference(y: Tensor, order: Tensor, topk_weight: Tensor) -> Tensor:
    return _gather_weighted(y, inverse_order(order), topk_weight)


def _gather_weighted(y: Tensor, inverse: Tensor, w: Tensor) -> Tensor:
    S, k = w.shape
    # index_select: its backward is an index_add over a permutation (y[inverse]'s is an
    # accumulating index_put, ~20x slower on a CPU)
    y_tk = y.index_select(0, inverse).view(S, k, y.shape[-1])  # [S, k, l] in (token, k) order
    return (y_tk.to(w.dtype) * w.unsqueeze(-1)).sum(1)


def weighted_combine(y: Tensor, order: Tensor, topk_weight: Tensor) -> Tensor:
    """y [S*k, l] (any float dtype), order [S*k], topk_weight [S, k] -> [S, l] in w's dtype."""
    S, k = topk_weight.shape
    if y.shape[0] != S * k or order.shape != (S * k,):
        raise ValueError(f"combine: y {tuple(y.shape)} and order {tuple(order.shape)} must "
                         f"have S*k = {S * k} rows")
    if not use_fused_kernel(y, _ENV):
        return weighted_combine_reference(y, order, topk_weight)
    return _combine_op(y.contiguous(), inverse_order(order), topk_weight.contiguous())


@torch.library.custom_op("k3::moe_combine", mutates_args=())
def _combine_op(y: Tensor, inverse: Tensor, w: Tensor) -> Tensor:
    """[S, l] in w's dtype: sum_j w[s, j] y[inverse[s k + j]]."""
    if triton_chosen(y, _ENV):
        from model.ops import combine_triton

        return combine_triton.combine_fwd(y, inverse, w)
    return _gather_weighted(y, inverse, w)


@_combine_op.register_fake
def _(y, inverse, w):
    return y.new_empty((w.shape[0], y.shape[-1]), dtype=w.dtype)


@torch.library.custom_op("k3::moe_combine_bwd", mutates_args=())
def _combine_bwd_op(dout: Tensor, y: Tensor, inverse: Tensor, w: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """(d y in y's dtype and layout: dy[inverse[s k + j]] = w[s, j] dout[s]; d w [S, k]:
    <y[inverse[s k + j]], dout[s]>)."""
    if triton_chosen(y, _ENV):
        from model.ops import combine_triton

        return combine_triton.combine_bwd(dout.contiguous(), y, inverse, w)
    S, k = w.shape
    dy_tk = (w.unsqueeze(-1) * dout.unsqueeze(1)).reshape(S * k, -1)  # (token, k) order
    dy = torch.empty_like(y)
    dy[inverse] = dy_tk.to(y.dtype)
    dw = (y.index_select(0, inverse).view(S, k, -1).to(w.dtype) * dout.unsqueeze(1)).sum(-1)
    return dy, dw


@_combine_bwd_op.register_fake
def _(dout, y, inverse, w):
    return torch.empty_like(y), torch.empty_like(w)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout: Tensor):
    y, inverse, w = ctx.saved_tensors
    dy, dw = _combine_bwd_op(dout, y, inverse, w)
    return dy, None, dw


_combine_op.register_autograd(_backward, setup_context=_setup)

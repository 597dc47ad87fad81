"""Causal depthwise short convolution + SiLU with document resets (KDA's q/k/v convs).

y_t = silu( sum_s w[K-1-s] * x_{t-s} ), summed over the taps s with s <= t (inside the row) and
s <= the token's position in its document, so a packed batch equals each document alone.

* `short_conv_silu(x, weight, pos_in_doc)`: the op the model calls. With the Triton backend
  (CUDA, 16/32-bit, or `K3_CONV_BACKEND=triton`; and in fake-tensor traces under
  `force_cuda_backends()`) it is the custom op `k3::short_conv` / `k3::short_conv_bwd` over our
  kernels (`model.ops.short_conv_triton`): the forward reads x once and writes y; the backward
  recomputes the pre-activations it needs from x (no saved activation) and writes dx and
  per-tile weight-gradient partials. Document resets come from `pos_in_doc`, which is on the
  device already; fla's varlen `causal_conv1d` wants chunk indices built from `cu_seqlens` on the
  host (a sync unless given a host copy), lives in different modules in fla 0.5 and 0.6 and
  cannot run in CI, so the kernel is ours. Otherwise (CPU, float64) it is the reference below.
* `short_conv_silu_reference`: K shifted multiply-adds (a loop over the K = 4 taps, never over
  tokens) under autograd: the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.ops.backends import compute_dtype, triton_chosen, use_fused_kernel

_ENV = "K3_CONV_BACKEND"


def short_conv_silu_reference(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    """x [B, T, C], weight [C, K], pos_in_doc [B, T] -> silu(conv(x)) [B, T, C] in x's dtype."""
    T, K = x.shape[1], weight.shape[-1]
    compute = compute_dtype(x)
    xf = x.to(compute)
    w = weight.to(compute)
    y = xf * w[:, -1]
    for s in range(1, K):
        shifted = F.pad(xf, (0, 0, s, 0))[:, :T]  # [B, T, C] = x_{t-s}
        keep = (pos_in_doc >= s).unsqueeze(-1).to(compute)  # [B, T, 1]
        y = y + shifted * keep * w[:, -1 - s]
    return F.silu(y).to(x.dtype)


def _conv_bwd_torch(dy: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """The backward written out (forced off CUDA, float64): dz = dy silu'(z);
    dx_t = sum_s dz_{t+s} w[K-1-s] keep_s(t+s); dw[:, K-1-s] = sum dz_t x_{t-s} keep_s(t)."""
    T, K = x.shape[1], weight.shape[-1]
    compute = compute_dtype(x)
    xf, w, g = x.to(compute), weight.to(compute), dy.to(compute)
    keeps = [(pos_in_doc >= s).unsqueeze(-1).to(compute) for s in range(K)]  # [B, T, 1]
    z = xf * w[:, -1]
    for s in range(1, K):
        z = z + F.pad(xf, (0, 0, s, 0))[:, :T] * keeps[s] * w[:, -1 - s]
    sig = torch.sigmoid(z)
    dz = g * sig * (1 + z * (1 - sig))
    dx = dz * w[:, -1]
    dw = torch.empty_like(w)
    dw[:, -1] = (dz * xf).sum((0, 1))
    for s in range(1, K):
        tap = dz * keeps[s]  # the taps of t+s that reach back to t
        dx = dx + F.pad(tap, (0, 0, 0, s))[:, s:] * w[:, -1 - s]
        dw[:, -1 - s] = (tap * F.pad(xf, (0, 0, s, 0))[:, :T]).sum((0, 1))
    return dx.to(x.dtype), dw.to(weight.dtype)


def short_conv_silu(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    """x [B, T, C], weight [C, K] (fp32 master), pos_in_doc [B, T] -> [B, T, C] in x's dtype."""
    if x.dim() != 3 or weight.shape[0] != x.shape[-1] or pos_in_doc.shape != x.shape[:2]:
        raise ValueError(f"short conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"pos_in_doc {tuple(pos_in_doc.shape)} do not fit [B, T, C], [C, K], "
                         "[B, T]")
    if not use_fused_kernel(x, _ENV):
        return short_conv_silu_reference(x, weight, pos_in_doc)
    return _conv_op(x.contiguous(), weight.contiguous(), pos_in_doc.contiguous())


@torch.library.custom_op("k3::short_conv", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    """silu(causal depthwise conv) with document resets, in x's dtype."""
    if triton_chosen(x, _ENV):
        from model.ops import short_conv_triton

        return short_conv_triton.conv_fwd(x, weight, pos_in_doc)
    with torch.no_grad():  # forced off CUDA, or float64: the reference formula
        return short_conv_silu_reference(x, weight, pos_in_doc)


@_conv_op.register_fake
def _(x, weight, pos_in_doc):
    return torch.empty_like(x)


@torch.library.custom_op("k3::short_conv_bwd", mutates_args=())
def _conv_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """(d x in x's dtype, d weight in weight's dtype) of k3::short_conv."""
    if triton_chosen(x, _ENV):
        from model.ops import short_conv_triton

        return short_conv_triton.conv_bwd(dy.contiguous(), x, weight, pos_in_doc)
    return _conv_bwd_torch(dy, x, weight, pos_in_doc)


@_conv_bwd_op.register_fake
def _(dy, x, weight, pos_in_doc):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: Tensor):
    x, weight, pos_in_doc = ctx.saved_tensors
    dx, dw = _conv_bwd_op(dy, x, weight, pos_in_doc)
    return dx, dw, None


_conv_op.register_autograd(_backward, setup_context=_setup)

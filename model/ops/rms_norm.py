"""Row norms of the model: RMSNorm (weighted, mean of squares, optionally sigmoid-gated: KDA's
output norm) and the per-head L2 norm.

y = x * rsqrt(scale * sum(x²) + eps) * weight [* sigmoid(gate)], fp32 inside, y in x's dtype;
scale = 1/d for RMSNorm, 1 for the L2 norm (which has no weight).

* `rms_norm(x, weight, eps)`, `gated_rms_norm(x, weight, gate, eps)`, `l2_norm(x, eps)`: what
  the model calls. With the Triton backend
  (CUDA, 16/32-bit, or `K3_NORM_BACKEND=triton`; and in fake-tensor traces under
  `force_cuda_backends()`) they are the custom op `k3::row_norm` / `k3::row_norm_bwd` over our
  kernels (`model.ops.rms_norm_triton`): the forward reads each row twice (from cache the second
  time) and keeps only rstd [rows] fp32; the backward reads x, dy (and the gate) once each,
  writes dx (and d gate) and per-program weight-gradient partials. Otherwise (CPU, float64)
  they are the references.
* `rms_norm_reference`, `gated_rms_norm_reference`, `l2_norm_reference`: the formulas under
  autograd (the oracles). The gated reference rounds the norm to x's dtype before the gate, as
  K3's module always did; the kernel gates in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.ops.backends import compute_dtype, triton_chosen, use_fused_kernel

_ENV = "K3_NORM_BACKEND"


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight over the last dim, fp32 inside (float64 stays float64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


def gated_rms_norm_reference(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """rms_norm(x) * sigmoid(gate) (fla's FusedRMSNormGated, activation "sigmoid")."""
    y = rms_norm_reference(x, weight, eps)
    compute = torch.promote_types(y.dtype, torch.float32)
    return (y.to(compute) * torch.sigmoid(gate.to(compute))).to(x.dtype)


def l2_norm_reference(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim (fla's l2norm), fp32 inside."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if not use_fused_kernel(x, _ENV):
        return rms_norm_reference(x, weight, eps)
    return _norm(x, weight, None, eps, True)


def gated_rms_norm(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    if not use_fused_kernel(x, _ENV):
        return gated_rms_norm_reference(x, weight, gate, eps)
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    return _norm(x, weight, gate.contiguous(), eps, True)


def l2_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    if not use_fused_kernel(x, _ENV):
        return l2_norm_reference(x, eps)
    return _norm(x, None, None, eps, False)


def _norm(x: Tensor, weight: Tensor | None, gate: Tensor | None, eps: float, mean: bool
          ) -> Tensor:
    d = x.shape[-1]
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"norm weight {tuple(weight.shape)} must be [{d}]")
    return _norm_op(x.contiguous(), weight, gate, float(eps), mean)[0]


def _rstd_torch(x: Tensor, eps: float, mean: bool) -> Tensor:
    xf = x.to(compute_dtype(x))
    ss = xf.pow(2).mean(-1) if mean else xf.pow(2).sum(-1)
    return torch.rsqrt(ss + eps)


@torch.library.custom_op("k3::row_norm", mutates_args=())
def _norm_op(x: Tensor, weight: Tensor | None, gate: Tensor | None, eps: float, mean: bool
             ) -> tuple[Tensor, Tensor]:
    """(y in x's dtype, rstd [...] in fp32 / fp64)."""
    if triton_chosen(x, _ENV):
        from model.ops import rms_norm_triton

        return rms_norm_triton.norm_fwd(x, weight, gate, eps, mean)
    rstd = _rstd_torch(x, eps, mean)
    y = x.to(compute_dtype(x)) * rstd[..., None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    if gate is not None:
        y = y * torch.sigmoid(gate.to(y.dtype))
    return y.to(x.dtype), rstd


@_norm_op.register_fake
def _(x, weight, gate, eps, mean):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=compute_dtype(x))


@torch.library.custom_op("k3::row_norm_bwd", mutates_args=())
def _norm_bwd_op(dy: Tensor, x: Tensor, weight: Tensor | None, gate: Tensor | None,
                 rstd: Tensor, mean: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(d x in x's dtype, d weight in weight's dtype or [0] without a weight, d gate or [0]):
    with s = sigmoid(gate) (1 without), n = xhat w, xhat = x r: d gate = dy n s (1 - s);
    g = dy s w; dx = r (g - xhat * scale * sum(g xhat)); dw = sum_rows dy s xhat."""
    if triton_chosen(x, _ENV):
        from model.ops import rms_norm_triton

        return rms_norm_triton.norm_bwd(dy.contiguous(), x, weight, gate, rstd, mean)
    compute = compute_dtype(x)
    r = rstd.to(compute)[..., None]
    xhat = x.to(compute) * r
    dyf = dy.to(compute)
    dgate = x.new_empty(0)
    if gate is not None:
        s = torch.sigmoid(gate.to(compute))
        n = xhat * weight.to(compute) if weight is not None else xhat
        dgate = (dyf * n * s * (1 - s)).to(gate.dtype)
        dyf = dyf * s
    g = dyf * weight.to(compute) if weight is not None else dyf
    scale = 1.0 / x.shape[-1] if mean else 1.0
    dx = r * (g - xhat * (scale * (g * xhat).sum(-1, keepdim=True)))
    if weight is None:
        return dx.to(x.dtype), x.new_empty(0), dgate
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), dgate


@_norm_bwd_op.register_fake
def _(dy, x, weight, gate, rstd, mean):
    return (torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(weight),
            x.new_empty(0) if gate is None else torch.empty_like(gate))


def _setup(ctx, inputs, output) -> None:
    x, weight, gate, _eps, mean = inputs
    ctx.save_for_backward(x, weight, gate, output[1])
    ctx.mean = mean
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy: Tensor, _drstd: Tensor | None):
    x, weight, gate, rstd = ctx.saved_tensors
    dx, dw, dgate = _norm_bwd_op(dy, x, weight, gate, rstd, ctx.mean)
    return (dx, None if weight is None else dw, None if gate is None else dgate, None, None)


_norm_op.register_autograd(_backward, setup_context=_setup)

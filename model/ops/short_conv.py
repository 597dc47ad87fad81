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
  cannot run in CI, so the kernel is ours. On a CPU (16/32-bit, `K3_CONV_BACKEND=auto`) the
  same custom op runs oneDNN's depthwise convolution instead (`_conv_fwd_cpu` /
  `_conv_bwd_cpu`): x [B, T, C] is already the channels-last layout of a [B, C, 1, T] image, so
  the convolution reads it in place, and the taps that reach across a document start (at most
  K - 1 tokens per document) are subtracted afterwards on just those rows (~1.8x faster
  forward+backward than the reference under autograd, `benchmarks/fused_ops_cpu.py`).
  Otherwise (float64, or `K3_CONV_BACKEND=torch`) it is the reference below.
* `short_conv_silu_reference`: K shifted multiply-adds (a loop over the K = 4 taps, never over
  tokens) under autograd: the oracle.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from model.ops.backends import (
    compile_constant,
    compute_dtype,
    cpu_run,
    triton_chosen,
    use_fused_kernel,
)

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


def _cross_doc_taps(x: Tensor, weight: Tensor, pos_in_doc: Tensor
                    ) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """The taps an unmasked causal convolution adds across document starts: rows (b, t) of
    tokens with pos < K - 1 and, per tap s = 1..K-1, (source rows t - s clamped at 0, a [M, 1]
    weight: 1 where pos_t < s <= t, i.e. the tap reaches into an earlier document, else 0).
    The `nonzero` is a host read: CPU path of the custom op only (listed in
    `model.ops.HOST_SYNC_OPS`; CUDA runs the Triton kernel, traces the fake implementation)."""
    K = weight.shape[-1]
    b, t = (pos_in_doc < K - 1).nonzero(as_tuple=True)
    p = pos_in_doc[b, t]
    taps = [((t - s).clamp(min=0), ((p < s) & (t >= s)).to(x.dtype).unsqueeze(-1))
            for s in range(1, K)]
    return b, t, taps


def _conv_pre_cpu(x: Tensor, weight: Tensor, pos_in_doc: Tensor
                  ) -> tuple[Tensor, Tensor, tuple]:
    """(z [B, T, C] pre-activation, a strided view of the convolution's output; x4, the
    [B, C, 1, T] channels-last view of x; the cross-document taps), in the compute dtype."""
    T, C = x.shape[1:]
    K = weight.shape[-1]
    x4 = x.permute(0, 2, 1).unsqueeze(2)  # [B, C, 1, T], strides of channels_last: no copy
    w4 = weight.view(C, 1, 1, K)
    z = F.conv2d(x4, w4, padding=(0, K - 1), groups=C)[..., :T].squeeze(2).permute(0, 2, 1)
    cross = _cross_doc_taps(x, weight, pos_in_doc)
    b, t, taps = cross
    if b.numel():
        corr = sum(m * weight[:, K - 1 - s] * x[b, src] for s, (src, m) in enumerate(taps, 1))
        z[b, t] -= corr
    return z, x4, cross


def _conv_fwd_cpu(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    compute = compute_dtype(x)
    z, _, _ = _conv_pre_cpu(x.to(compute), weight.to(compute), pos_in_doc)
    y = torch.empty(x.shape, dtype=compute, device=x.device)
    torch.ops.aten.silu.out(z, out=y)
    return y.to(x.dtype)


def _conv_bwd_cpu(dy: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """dz = dy silu'(z) (z recomputed) written into the convolution's output gradient (its
    K - 1 positions past T are zero); oneDNN's convolution backward gives the unmasked dx and
    dw; the cross-document taps' terms come off again on their rows."""
    B, T, C = x.shape
    K = weight.shape[-1]
    compute = compute_dtype(x)
    xf, w = x.to(compute), weight.to(compute)
    z, x4, (b, t, taps) = _conv_pre_cpu(xf, w, pos_in_doc)
    # the convolution's output gradient (channels-last): dz, then zeros past T
    g_full = torch.empty(B, T + K - 1, C, dtype=compute, device=x.device)
    g_full[:, T:] = 0
    dz = g_full[:, :T]
    torch.ops.aten.silu_backward.grad_input(dy.to(compute), z, grad_input=dz)
    dx4, dw4, _ = torch.ops.aten.convolution_backward(
        g_full.permute(0, 2, 1).unsqueeze(2), x4, w.view(C, 1, 1, K), None, [1, 1],
        [0, K - 1], [1, 1], False, [0, 0], C, [True, True, False])
    dx = dx4.squeeze(2).permute(0, 2, 1).contiguous()  # [B, T, C] (a view already)
    dw = dw4.view(C, K).clone()
    if b.numel():
        g = dz[b, t]  # [M, C]
        for s, (src, m) in enumerate(taps, 1):
            gm = g * m
            dx.index_put_((b, src), -gm * w[:, K - 1 - s], accumulate=True)
            dw[:, K - 1 - s] -= (gm * xf[b, src]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@compile_constant
def _use_cpu_conv(device: torch.device, dtype: torch.dtype) -> bool:
    """Constant for a compiled graph: the CPU path is taken on CPU, 16/32-bit, `auto`."""
    return device.type == "cpu" and dtype != torch.float64 \
        and os.environ.get(_ENV, "auto") == "auto"


def short_conv_silu(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    """x [B, T, C], weight [C, K] (fp32 master), pos_in_doc [B, T] -> [B, T, C] in x's dtype."""
    if x.dim() != 3 or weight.shape[0] != x.shape[-1] or pos_in_doc.shape != x.shape[:2]:
        raise ValueError(f"short conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"pos_in_doc {tuple(pos_in_doc.shape)} do not fit [B, T, C], [C, K], "
                         "[B, T]")
    if not (use_fused_kernel(x, _ENV) or _use_cpu_conv(x.device, x.dtype)):
        return short_conv_silu_reference(x, weight, pos_in_doc)
    return _conv_op(x.contiguous(), weight.contiguous(), pos_in_doc.contiguous())


@torch.library.custom_op("k3::short_conv", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    """silu(causal depthwise conv) with document resets, in x's dtype."""
    if triton_chosen(x, _ENV):
        from model.ops import short_conv_triton

        return short_conv_triton.conv_fwd(x, weight, pos_in_doc)
    if cpu_run(x.device):  # a CPU run, not a GPU trace
        return _conv_fwd_cpu(x, weight, pos_in_doc)
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
    if cpu_run(x.device):  # a CPU run, not a GPU trace
        return _conv_bwd_cpu(dy, x, weight, pos_in_doc)
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

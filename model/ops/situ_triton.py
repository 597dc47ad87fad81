"""Triton kernels of SiTU-GLU (`model.ops.situ`): elementwise over the flattened (gate, up).

Forward: one read of gate and up, one write; backward: one read of dout, gate and up, two
writes, the transcendentals recomputed. fp32 inside, I/O in the inputs' dtype. tanh is written
out (odd Taylor series below |x| < 1/16, else (1 - e^-2|x|) / (1 + e^-2|x|) with the sign),
and so are its derivative 1 - tanh² = 4e / (1 + e)² and 1 - sigmoid(g) = e^-g sigmoid(g)
(g >= 0), both without the cancellation of the textbook forms (they keep their relative
accuracy in the tails);
libdevice's tanh does not run under TRITON_INTERPRET=1, which is how CI checks these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _tanh_sech2(x):
    """(tanh x, 1 - tanh² x = 4e / (1 + e)², e = exp(-2|x|): no cancellation when |x| is big)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.0625, small, tl.where(x < 0, -big, big))
    return t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _situ_fwd_kernel(g_ptr, u_ptr, out_ptr, n, B1: tl.constexpr, B2: tl.constexpr,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sg = 1.0 / (1.0 + tl.exp(-g))
    tg, _ = _tanh_sech2(g / B1)
    tu, _ = _tanh_sech2(u / B2)
    out = (B1 * B2) * tg * sg * tu
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, B1: tl.constexpr,
                     B2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tg, sech2g = _tanh_sech2(g / B1)
    tu, sech2u = _tanh_sech2(u / B2)
    eg = tl.exp(-g)
    sg = 1.0 / (1.0 + eg)
    one_minus_sg = tl.where(g >= 0, eg * sg, 1.0 - sg)  # e^-g sigmoid(g) where it is small
    dsitu = sech2g * sg + B1 * tg * sg * one_minus_sg
    tl.store(dg_ptr + offs, (do * B2 * tu * dsitu).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (do * B1 * tg * sg * sech2u).to(du_ptr.dtype.element_ty),
             mask=mask)


def situ_fwd(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _situ_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, out, n, B1=beta, B2=linear_beta,
                                                    BLOCK=_BLOCK)
    return out


def situ_bwd(dout: Tensor, gate: Tensor, up: Tensor, beta: float, linear_beta: float
             ) -> tuple[Tensor, Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _situ_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dout, gate, up, dgate, dup, n, B1=beta,
                                                    B2=linear_beta, BLOCK=_BLOCK)
    return dgate, dup

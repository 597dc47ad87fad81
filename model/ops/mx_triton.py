"""Triton kernel of the MXFP8 cast (`model.ops.mx`): one read of x, one write of the result.

A program quantises a [32, BLOCK_I] tile: 32 elements along the block axis (one MX block) for
BLOCK_I independent columns, so a block's amax is a reduction inside the tile. The tensor is
seen as [B, L, C] with the blocks along L and C independent columns (strides from the caller);
a partial last block is read as zeros, which never change a block's amax (`pad_to_block`'s
rule).

Bit-exact with `model.ops.mx.mx_quantize` by construction, all in integer and exact float
arithmetic (no log2, no division, no fp8 dtype, so it also runs under TRITON_INTERPRET=1):
- scale exponent from amax's float bits: e = exponent - 8, plus 1 in "rceil" mode when the
  mantissa exceeds 1.75 (amax > 1.75 * 2^p needs one more power); zero or subnormal amax ->
  -127, Inf -> 127, clamped to [-127, 127]; a block holding a NaN gets scale byte 0xFF and
  all-NaN data;
- x * 2^-e as two exact power-of-two multiplies (each factor a normal float), clamped to +-448;
- round-to-nearest-even to e4m3: ulp = 2^(max(exp, -6) - 3), t = |y| / ulp < 16, rounded by
  adding and subtracting 2^23 (fp32's own RNE; the product is exact, so an FMA contraction
  rounds the same way); the sign comes from the sign bit (-0.0 stays -0.0).
Outputs: the e4m3 bytes and the e8m0 scale bytes, or (``FAKE``) the dequantised values q * 2^e
in the output's dtype (exact in bf16 / fp32: 4 significant bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_I = 64


@triton.jit
def _pow2(k):
    """Exact 2^k as float32 for int32 k in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_cast_kernel(x_ptr, q_ptr, s_ptr, L, C, n_blk, n_it,
                    sxb, sxl, sxi, sqb, sql, sqi, ssb, ssl, ssi,
                    FLOOR: tl.constexpr, FAKE: tl.constexpr, BLOCK_I: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    it = pid % n_it
    blk = (pid // n_it) % n_blk
    b = pid // (n_it * n_blk)
    rows = blk * 32 + tl.arange(0, 32)  # along L: one MX block
    cols = it * BLOCK_I + tl.arange(0, BLOCK_I)  # independent columns
    live = (rows[:, None] < L) & (cols[None, :] < C)
    x = tl.load(x_ptr + b * sxb + rows[:, None] * sxl + cols[None, :] * sxi, mask=live,
                other=0.0).to(tl.float32)
    nan = x != x
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0  # [BLOCK_I]
    amax = tl.max(tl.where(nan, 0.0, tl.abs(x)), axis=0)
    abits = amax.to(tl.int32, bitcast=True)
    efield = (abits >> 23) & 0xFF
    e = efield - 135  # floor(log2 amax) - 8
    if not FLOOR:
        e += ((abits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa > 1.75
    e = tl.where(efield == 255, 127, tl.where(efield == 0, -127, e))
    e = tl.minimum(tl.maximum(e, -127), 127)
    ne = -e
    h = ne >> 1
    y = x * _pow2(h)[None, :] * _pow2(ne - h)[None, :]
    ybits = y.to(tl.int32, bitcast=True)
    sign = ybits & (-2147483648)
    ay = tl.where(nan, 0.0, tl.minimum(tl.abs(y), 448.0))  # NaN blocks are overwritten below
    yexp = ((ay.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = tl.maximum(yexp, -6) - 3  # e4m3: 3 mantissa bits, subnormals below 2^-6
    t = ay * _pow2(-ulp)
    r = (t + 8388608.0) - 8388608.0  # round half to even: t < 16
    mag = r * _pow2(ulp)
    nan2 = has_nan[None, :]
    if FAKE:
        he = e >> 1
        out = mag * _pow2(he)[None, :] * _pow2(e - he)[None, :]
        out = (out.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        out = tl.where(nan2, float("nan"), out)
        tl.store(q_ptr + b * sqb + rows[:, None] * sql + cols[None, :] * sqi,
                 out.to(q_ptr.dtype.element_ty), mask=live)
    else:
        mbits = mag.to(tl.int32, bitcast=True)
        mexp = ((mbits >> 23) & 0xFF) - 127
        normal = (mexp + 7) * 8 + ((mbits >> 20) & 7)
        code = tl.where(mag >= 0.015625, normal, r.to(tl.int32))  # 2^-6: e4m3's min normal
        code = code | ((sign >> 24) & 0x80)
        code = tl.where(nan2, 0x7F, code)
        tl.store(q_ptr + b * sqb + rows[:, None] * sql + cols[None, :] * sqi,
                 code.to(tl.uint8), mask=live)
    sbyte = tl.where(has_nan, 255, e + 127).to(tl.uint8)
    tl.store(s_ptr + b * ssb + blk * ssl + cols * ssi, sbyte, mask=cols < C)


def mx_cast(x: Tensor, dim: int, floor: bool, fake: bool) -> tuple[Tensor, Tensor]:
    """(q, scale bytes) of contiguous x along `dim`: q the e4m3 bytes (uint8, x's shape) or,
    with ``fake``, the dequantised values in x's dtype; scales uint8 with shape[dim] =
    ceil(L / 32)."""
    shape = x.shape
    d = dim % x.ndim
    L = shape[d]
    nb = triton.cdiv(L, 32)
    inner = 1
    for n in shape[d + 1:]:
        inner *= n
    outer = x.numel() // max(L * inner, 1)
    q = torch.empty_like(x) if fake else torch.empty(shape, dtype=torch.uint8, device=x.device)
    s_shape = (*shape[:d], nb, *shape[d + 1:])
    scale = torch.empty(s_shape, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return q, scale
    if inner == 1:  # blocks along the last dim: the columns are the rows of [outer, L]
        B, C = 1, outer
        xs, ss = (0, 1, L), (0, 1, nb)
    else:
        B, C = outer, inner
        xs, ss = (L * inner, inner, 1), (nb * inner, inner, 1)
    n_it = triton.cdiv(C, _BLOCK_I)
    _mx_cast_kernel[(B * nb * n_it,)](x, q, scale, L, C, nb, n_it, *xs, *xs, *ss,
                                      FLOOR=floor, FAKE=fake, BLOCK_I=_BLOCK_I)
    return q, scale

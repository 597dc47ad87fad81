"""Triton kernels of the MoE combine (`model.ops.combine`): grid over tiles of BS tokens.

y [S*k, l] in grouped order, inverse [S*k] (row of y of flat pair s*k + j), w [S, k] fp32.
* forward (grid S-tiles x l-tiles): acc = sum_j w[s, j] y[inverse[s k + j]] in fp32, one store.
* backward (grid S-tiles, l in tiles inside): for each j, dy[inverse[s k + j]] = w[s, j] dout[s]
  (a permutation: every row of dy is written once) and dw[s, j] = sum_l y[...] dout[s].
Runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BS, _BL = 16, 128


@triton.jit
def _combine_fwd_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, S, L, K: tl.constexpr,
                        BS: tl.constexpr, BL: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BS + tl.arange(0, BS)
    cols = tl.program_id(1) * BL + tl.arange(0, BL)
    rmask, cmask = rows < S, cols < L
    acc = tl.zeros([BS, BL], dtype=tl.float32)
    for j in tl.static_range(K):
        src = tl.load(inv_ptr + rows * K + j, mask=rmask, other=0).to(tl.int64)
        wj = tl.load(w_ptr + rows * K + j, mask=rmask, other=0.0).to(tl.float32)
        v = tl.load(y_ptr + src[:, None] * L + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += wj[:, None] * v
    tl.store(out_ptr + rows[:, None] * L + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, inv_ptr, w_ptr, dy_ptr, dw_ptr, S, L: tl.constexpr,
                        K: tl.constexpr, BS: tl.constexpr, BL: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BS + tl.arange(0, BS)
    rmask = rows < S
    for j in tl.static_range(K):
        src = tl.load(inv_ptr + rows * K + j, mask=rmask, other=0).to(tl.int64)
        wj = tl.load(w_ptr + rows * K + j, mask=rmask, other=0.0).to(tl.float32)
        dot = tl.zeros([BS], dtype=tl.float32)
        for l0 in range(0, L, BL):
            cols = l0 + tl.arange(0, BL)
            m = rmask[:, None] & (cols < L)[None, :]
            g = tl.load(dout_ptr + rows[:, None] * L + cols[None, :], mask=m,
                        other=0.0).to(tl.float32)
            v = tl.load(y_ptr + src[:, None] * L + cols[None, :], mask=m,
                        other=0.0).to(tl.float32)
            tl.store(dy_ptr + src[:, None] * L + cols[None, :],
                     (wj[:, None] * g).to(dy_ptr.dtype.element_ty), mask=m)
            dot += tl.sum(v * g, axis=1)
        tl.store(dw_ptr + rows * K + j, dot.to(dw_ptr.dtype.element_ty), mask=rmask)


def combine_fwd(y: Tensor, inverse: Tensor, w: Tensor) -> Tensor:
    S, K = w.shape
    L = y.shape[-1]
    out = y.new_empty((S, L), dtype=w.dtype)
    if S and L:
        _combine_fwd_kernel[(triton.cdiv(S, _BS), triton.cdiv(L, _BL))](
            y, inverse, w, out, S, L, K=K, BS=_BS, BL=_BL)
    return out


def combine_bwd(dout: Tensor, y: Tensor, inverse: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    S, K = w.shape
    L = y.shape[-1]
    dy, dw = torch.empty_like(y), torch.empty_like(w)
    if S and L:
        _combine_bwd_kernel[(triton.cdiv(S, _BS),)](dout, y, inverse, w, dy, dw, S, L, K=K,
                                                    BS=_BS, BL=_BL)
    return dy, dw

"""Triton kernels of the document-resetting short convolution + SiLU (`model.ops.short_conv`).

x [B, T, C] contiguous, weight [C, K] (K <= 8, constexpr), pos_in_doc [B, T]; grid over tiles of
BT flattened rows (b * T + t) by BC channels. A tap s reaches row r - s when t >= s and
pos_in_doc[r] >= s (the reference's zero padding and document reset).
* forward: z = sum_s w[K-1-s] x[r-s] keep_s(r), y = z sigmoid(z): one read of x (the shifted
  loads of a tile hit the cache), one write.
* backward: for each shift j the pre-activation of row r + j is recomputed from x (K² cached
  loads, no saved activation), dz = dy silu'(z); dx[r] = sum_j dz[r+j] w[K-1-j] keep_j(r+j);
  the tile's weight-gradient partial sum_r dz[r] x[r-s] keep_s(r) goes to its own row of a
  [tiles, C, K] fp32 buffer (no atomics), summed afterwards.
fp32 inside, I/O in x's dtype. Runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BT, _BC = 32, 64


@triton.jit
def _tap(x_ptr, pos_ptr, rows, t, cols, cmask, C, N, s: tl.constexpr):
    """x[r - s] * keep_s(r) for the tile's rows (0 where the tap is dropped), fp32 [BT, BC]."""
    rmask = rows < N
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    keep = rmask & (t >= s) & (pos >= s)
    src = tl.where(keep, rows - s, 0)
    v = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=keep[:, None] & cmask[None, :],
                other=0.0)
    return v.to(tl.float32)


@triton.jit
def _preact(x_ptr, w_ptr, pos_ptr, rows, T, cols, cmask, C, N, K: tl.constexpr):
    t = rows % T
    z = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for s in tl.static_range(K):
        w = tl.load(w_ptr + cols * K + (K - 1 - s), mask=cmask, other=0.0).to(tl.float32)
        z += _tap(x_ptr, pos_ptr, rows, t, cols, cmask, C, N, s) * w[None, :]
    return z


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, T, C, N, K: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    z = _preact(x_ptr, w_ptr, pos_ptr, rows, T, cols, cmask, C, N, K)
    y = z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + rows[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & cmask[None, :])


@triton.jit
def _conv_bwd_kernel(dy_ptr, x_ptr, w_ptr, pos_ptr, dx_ptr, dw_ptr, T, C, N,
                     K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile.to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    t = rows % T
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        # rows q = r + j: their pre-activation, dz, and the tap j that reaches back to r
        q = rows + j
        qmask = q < N
        z = _preact(x_ptr, w_ptr, pos_ptr, q, T, cols, cmask, C, N, K)
        dyq = tl.load(dy_ptr + q[:, None] * C + cols[None, :],
                      mask=qmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-z))
        dz = dyq * sig * (1.0 + z * (1.0 - sig))
        posq = tl.load(pos_ptr + q, mask=qmask, other=0)
        reach = qmask & ((q % T) >= j) & (posq >= j)
        w = tl.load(w_ptr + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
        dx += tl.where(reach[:, None], dz, 0.0) * w[None, :]
        if j == 0:  # the weight-gradient partial of this tile's own rows
            for s in tl.static_range(K):
                xs = _tap(x_ptr, pos_ptr, rows, t, cols, cmask, C, N, s)
                tl.store(dw_ptr + (tile.to(tl.int64) * C + cols) * K + (K - 1 - s),
                         tl.sum(dz * xs, axis=0), mask=cmask)
    tl.store(dx_ptr + rows[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & cmask[None, :])


def _grid(N: int, C: int) -> tuple[int, int]:
    return triton.cdiv(N, _BT), triton.cdiv(C, _BC)


def conv_fwd(x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> Tensor:
    B, T, C = x.shape
    y = torch.empty_like(x)
    if x.numel():
        _conv_fwd_kernel[_grid(B * T, C)](x, weight, pos_in_doc, y, T, C, B * T,
                                          K=weight.shape[-1], BT=_BT, BC=_BC)
    return y


def conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor) -> tuple[Tensor, Tensor]:
    B, T, C = x.shape
    K = weight.shape[-1]
    grid = _grid(B * T, C)
    dx = torch.empty_like(x)
    part = x.new_zeros((max(grid[0], 1), C, K), dtype=torch.float32)
    if x.numel():
        _conv_bwd_kernel[grid](dy, x, weight, pos_in_doc, dx, part, T, C, B * T, K=K, BT=_BT,
                               BC=_BC)
    return dx, part.sum(0).to(weight.dtype)

"""Triton kernels of the row norms (`model.ops.rms_norm`): RMSNorm (optionally sigmoid-gated)
and the per-head L2 norm.

x viewed as [M, d] contiguous; r = rsqrt(scale * sum(x²) + eps), scale = 1/d (RMS) or 1 (L2).
* forward (grid M): pass 1 over d-tiles sums x², pass 2 writes y = x r (w) (sigmoid(gate));
  stores r fp32.
* backward (grid P <= M, rows pid, pid + P, ...; the tail masked): per row, pass 1 gives
  c = scale * sum(g xhat) (g = dy s w, s = sigmoid(gate) or 1, xhat = x r), pass 2 writes
  dx = r (g - xhat c), d gate = dy xhat w s (1 - s), and adds dy s xhat into the program's own
  row of a [P, d] fp32 partial (no atomics), summed afterwards.
fp32 inside, I/O in x's dtype. Runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.ops.backends import kernel_programs
from model.ops.triton_rows import strided_row


@triton.jit
def _norm_fwd_kernel(x_ptr, w_ptr, gate_ptr, y_ptr, rstd_ptr, eps, D: tl.constexpr,
                     SCALE: tl.constexpr, HAS_W: tl.constexpr, HAS_GATE: tl.constexpr,
                     BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc += x * x
    r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) * SCALE + eps)
    tl.store(rstd_ptr + row, r)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cmask = cols < D
        y = tl.load(x_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32) * r
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_GATE:
            z = tl.load(gate_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-z))
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, gate_ptr, rstd_ptr, dx_ptr, dgate_ptr, part_ptr, M,
                     P, ROWS: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_GATE: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(0, ROWS):  # rows pid, pid + P, ...; the last may run past M (masked)
        row, valid = strided_row(pid, i, P, M)
        r = tl.load(rstd_ptr + row)
        acc = tl.zeros([BD], dtype=tl.float32)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cmask = cols < D
            x = tl.load(x_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_GATE:
                z = tl.load(gate_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
                g = g / (1.0 + tl.exp(-z))
            if HAS_W:
                g = g * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += g * x * r
        c = tl.sum(acc, axis=0) * SCALE
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cmask = cols < D
            xhat = tl.load(x_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32) * r
            dy = tl.load(dy_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            w = tl.full([BD], 1.0, tl.float32)
            if HAS_W:
                w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_GATE:
                z = tl.load(gate_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
                sg = 1.0 / (1.0 + tl.exp(-z))
                tl.store(dgate_ptr + row * D + cols,
                         (dy * xhat * w * sg * (1.0 - sg)).to(dgate_ptr.dtype.element_ty),
                         mask=cmask & valid)
                dy = dy * sg
            g = dy * w
            if HAS_W:
                part = tl.load(part_ptr + pid * D + cols, mask=cmask, other=0.0)
                tl.store(part_ptr + pid * D + cols,
                         part + tl.where(valid, dy * xhat, 0.0), mask=cmask)
            tl.store(dx_ptr + row * D + cols, (r * (g - xhat * c)).to(dx_ptr.dtype.element_ty),
                     mask=cmask & valid)


def _tile(d: int) -> int:
    return min(triton.next_power_of_2(d), 4096)


def norm_fwd(x: Tensor, weight: Tensor | None, gate: Tensor | None, eps: float, mean: bool
             ) -> tuple[Tensor, Tensor]:
    d = x.shape[-1]
    M = x.numel() // d if d else 0
    y = torch.empty_like(x)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    if M:
        _norm_fwd_kernel[(M,)](x, x if weight is None else weight, x if gate is None else gate,
                               y, rstd, eps, D=d, SCALE=1.0 / d if mean else 1.0,
                               HAS_W=weight is not None, HAS_GATE=gate is not None, BD=_tile(d))
    return y, rstd


def norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, gate: Tensor | None, rstd: Tensor,
             mean: bool) -> tuple[Tensor, Tensor, Tensor]:
    d = x.shape[-1]
    M = x.numel() // d if d else 0
    dx = torch.empty_like(x)
    dgate = x.new_empty(0) if gate is None else torch.empty_like(gate)
    programs = min(M, kernel_programs(x.device)) if M else 0
    part = x.new_zeros((max(programs, 1), d if weight is not None else 1), dtype=torch.float32)
    if programs:
        _norm_bwd_kernel[(programs,)](dy, x, x if weight is None else weight,
                                      x if gate is None else gate, rstd.contiguous(), dx,
                                      dx if gate is None else dgate, part, M, programs,
                                      ROWS=triton.cdiv(M, programs), D=d,
                                      SCALE=1.0 / d if mean else 1.0,
                                      HAS_W=weight is not None, HAS_GATE=gate is not None,
                                      BD=_tile(d))
    if weight is None:
        return dx, x.new_empty(0), dgate
    return dx, part.sum(0).to(weight.dtype), dgate


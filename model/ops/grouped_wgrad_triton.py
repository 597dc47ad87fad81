"""Triton grouped weight-gradient GEMM adding into its fp32 output (k3::grouped_wgrad_accumulate).

For each expert g: C[g] [out, in] += dy[rows of g].T @ x[rows of g], rows sorted by expert with
device end offsets (`k3::grouped_mm`'s layout: no host read of the group sizes). One program per
(out tile, in tile, expert) walks that expert's rows in BLOCK_K steps with fp32 accumulation on
the tensor cores, then reads its C tile once and writes it once: `torch._grouped_mm` has no
beta = 1 form, so without this kernel the experts' bf16 gradients take an extra cast-and-add
pass per micro-batch (`model.ops.wgrad`). An expert with no rows adds zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _grouped_wgrad_acc_kernel(dy_ptr, x_ptr, offs_ptr, c_ptr, OUT, IN, stride_dy, stride_x,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    end = tl.load(offs_ptr + g).to(tl.int64)
    start = tl.load(offs_ptr + tl.maximum(g - 1, 0)).to(tl.int64)
    start = tl.where(g > 0, start, 0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of C: the output features
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of C: the input features
    m_ok = rm < OUT
    n_ok = rn < IN
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < end
        a = tl.load(dy_ptr + rk[None, :] * stride_dy + rm[:, None],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # dy tile, transposed
        b = tl.load(x_ptr + rk[:, None] * stride_x + rn[None, :],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:  # fp32 operands (or, off CUDA, every dtype widened: the interpreter's
            # tl.dot misreads bf16 operands); bf16 products are exact in fp32
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    c_ptrs = c_ptr + g.to(tl.int64) * OUT * IN + rm[:, None] * IN + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(c_ptrs, tl.load(c_ptrs, mask=ok, other=0.0) + acc, mask=ok)


def _blocks(dy: Tensor) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps): H100/H200-sized tiles on CUDA, the smallest tl.dot
    tiles elsewhere (the interpreter's tests)."""
    if dy.is_cuda:
        return 128, 128, 64, 8
    return 16, 16, 16, 1


def grouped_wgrad_accumulate(c: Tensor, dy: Tensor, x: Tensor, offs: Tensor) -> None:
    """c [G, out, in] (fp32, contiguous) += per group dy[rows].T @ x[rows] (dy [S, out],
    x [S, in], both row-major, bf16 or fp32); `offs` [G] int32 end offsets."""
    if not c.is_contiguous():
        raise ValueError("grouped_wgrad_accumulate: main_grad must be contiguous")
    dy, x = dy.contiguous(), x.contiguous()
    groups, out, inp = c.shape
    bm, bn, bk, warps = _blocks(dy)
    grid = (triton.cdiv(out, bm), triton.cdiv(inp, bn), groups)
    _grouped_wgrad_acc_kernel[grid](dy, x, offs, c, out, inp, dy.stride(0), x.stride(0),
                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    IEEE=dy.dtype == torch.float32 or not dy.is_cuda,
                                    num_warps=warps)

"""Triton kernels of the AttnRes mix (`model.ops.attnres`): one program per token row.

Sources are the snapshot stack `blocks` [n, M, d] and the running `prefix` [M, d], read in
place: a [BN, BD] tile holds one row of every source (lanes 0..n-1 from `blocks`, lane n from
`prefix`, padding lanes masked), BN = next power of two of n + 1 (<= 16 for K3's 9 sources).
* forward (grid M): pass 1 over d accumulates each source's sum of squares and its dot with
  wq = norm_weight * query, giving rstd and the logits; softmax over the lanes in registers;
  pass 2 writes the weighted sum. Stores rstd and logits [N, M] fp32 for the backward.
* backward (grid P <= M, rows strided by P): per row, pass 1 gives dp_n = <source_n, dout>,
  then dl = p (dp - <p, dp>), c = dl rstd, a = -c logit rstd / d; pass 2 writes
  d source_n = a_n source_n + p_n dout + c_n wq and adds sum_n c_n source_n into the program's
  own row of a [P, d] fp32 partial (no atomics); d wq = the partial's column sum.
All maths fp32; I/O in the sources' dtype. Runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.ops.backends import kernel_programs
from model.ops.triton_rows import strided_row


@triton.jit
def _load_sources(blocks_ptr, prefix_ptr, row, M, cols, cmask, NB: tl.constexpr,
                  BN: tl.constexpr, D: tl.constexpr):
    """[BN, BD] fp32: lane i < NB is blocks[i, row, cols], lane NB is prefix[row, cols]."""
    lanes = tl.arange(0, BN)
    boff = lanes[:, None].to(tl.int64) * M * D + row * D + cols[None, :]
    v = tl.load(blocks_ptr + boff, mask=(lanes < NB)[:, None] & cmask[None, :], other=0.0)
    poff = row * D + cols[None, :] + lanes[:, None] * 0
    x = tl.load(prefix_ptr + poff, mask=(lanes == NB)[:, None] & cmask[None, :], other=0.0)
    return v.to(tl.float32) + x.to(tl.float32)


@triton.jit
def _mix_fwd_kernel(blocks_ptr, prefix_ptr, wq_ptr, out_ptr, rstd_ptr, logit_ptr, M, eps,
                    NB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BN)
    live = lanes <= NB
    ss = tl.zeros([BN], dtype=tl.float32)
    dot = tl.zeros([BN], dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cmask = cols < D
        v = _load_sources(blocks_ptr, prefix_ptr, row, M, cols, cmask, NB, BN, D)
        w = tl.load(wq_ptr + cols, mask=cmask, other=0.0)
        ss += tl.sum(v * v, axis=1)
        dot += tl.sum(v * w[None, :], axis=1)
    rstd = 1.0 / tl.sqrt(ss / D + eps)
    logit = dot * rstd
    z = tl.where(live, logit, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=0))
    p = e / tl.sum(e, axis=0)
    tl.store(rstd_ptr + lanes * M + row, rstd, mask=live)
    tl.store(logit_ptr + lanes * M + row, logit, mask=live)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cmask = cols < D
        v = _load_sources(blocks_ptr, prefix_ptr, row, M, cols, cmask, NB, BN, D)
        o = tl.sum(v * p[:, None], axis=0)
        tl.store(out_ptr + row * D + cols, o.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _mix_bwd_kernel(blocks_ptr, prefix_ptr, wq_ptr, dout_ptr, rstd_ptr, logit_ptr,
                    dblocks_ptr, dprefix_ptr, part_ptr, M, P, ROWS: tl.constexpr, NB: tl.constexpr,
                    D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(0, ROWS):  # rows pid, pid + P, ...; the last may run past M (masked)
        row, valid = strided_row(pid, i, P, M)
        lanes = tl.arange(0, BN)
        live = lanes <= NB  # an invalid row recomputes row 0 and stores nothing
        rstd = tl.load(rstd_ptr + lanes * M + row, mask=live, other=0.0)
        logit = tl.load(logit_ptr + lanes * M + row, mask=live, other=0.0)
        z = tl.where(live, logit, float("-inf"))
        e = tl.exp(z - tl.max(z, axis=0))
        p = e / tl.sum(e, axis=0)
        dp = tl.zeros([BN], dtype=tl.float32)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cmask = cols < D
            v = _load_sources(blocks_ptr, prefix_ptr, row, M, cols, cmask, NB, BN, D)
            g = tl.load(dout_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            dp += tl.sum(v * g[None, :], axis=1)
        dl = p * (dp - tl.sum(p * dp, axis=0))
        c = dl * rstd
        a = -c * logit * rstd / D
        cv = tl.where(valid, c, 0.0)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cmask = cols < D
            v = _load_sources(blocks_ptr, prefix_ptr, row, M, cols, cmask, NB, BN, D)
            g = tl.load(dout_ptr + row * D + cols, mask=cmask, other=0.0).to(tl.float32)
            w = tl.load(wq_ptr + cols, mask=cmask, other=0.0)
            ds = a[:, None] * v + p[:, None] * g[None, :] + c[:, None] * w[None, :]
            boff = lanes[:, None].to(tl.int64) * M * D + row * D + cols[None, :]
            tl.store(dblocks_ptr + boff, ds.to(dblocks_ptr.dtype.element_ty),
                     mask=((lanes < NB) & valid)[:, None] & cmask[None, :])
            dx = tl.sum(tl.where((lanes == NB)[:, None], ds, 0.0), axis=0)
            tl.store(dprefix_ptr + row * D + cols, dx.to(dprefix_ptr.dtype.element_ty),
                     mask=cmask & valid)
            part = tl.load(part_ptr + pid * D + cols, mask=cmask, other=0.0)
            tl.store(part_ptr + pid * D + cols, part + tl.sum(cv[:, None] * v, axis=0),
                     mask=cmask)


def _tiles(n_sources: int, d: int) -> tuple[int, int]:
    """(BN, BD): every source lane, and a d-tile of about 4096 fp32 values in total."""
    bn = triton.next_power_of_2(n_sources)
    return bn, min(triton.next_power_of_2(d), max(16, 4096 // bn))


def mix_fwd(blocks: Tensor, prefix: Tensor, wq: Tensor, eps: float
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(out [..., d] in prefix's dtype, rstd [N, M], logits [N, M] fp32)."""
    nb, d = blocks.shape[0], prefix.shape[-1]
    M = prefix.numel() // d
    out = torch.empty_like(prefix)
    rstd = prefix.new_empty((nb + 1, M), dtype=torch.float32)
    logits = torch.empty_like(rstd)
    bn, bd = _tiles(nb + 1, d)
    if M:
        blocks = blocks if nb else prefix  # never read (no lane < 0); a valid pointer
        _mix_fwd_kernel[(M,)](blocks, prefix, wq.float().contiguous(), out, rstd, logits, M,
                              eps, NB=nb, D=d, BN=bn, BD=bd)
    return out, rstd, logits


def mix_bwd(dout: Tensor, blocks: Tensor, prefix: Tensor, wq: Tensor, rstd: Tensor,
            logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(d blocks, d prefix in their dtypes, d wq [d] fp32)."""
    nb, d = blocks.shape[0], prefix.shape[-1]
    M = prefix.numel() // d
    dblocks, dprefix = torch.empty_like(blocks), torch.empty_like(prefix)
    programs = min(M, kernel_programs(prefix.device)) if M else 0
    part = prefix.new_zeros((max(programs, 1), d), dtype=torch.float32)
    bn, bd = _tiles(nb + 1, d)
    if programs:
        src, dsrc = (blocks, dblocks) if nb else (prefix, dprefix)  # n = 0: never touched
        _mix_bwd_kernel[(programs,)](src, prefix, wq.float().contiguous(), dout,
                                     rstd.contiguous(), logits.contiguous(), dsrc, dprefix,
                                     part, M, programs, triton.cdiv(M, programs), NB=nb, D=d,
                                     BN=bn, BD=bd)
    return dblocks, dprefix, part.sum(0)


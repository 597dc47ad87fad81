"""Native MXFP8 GEMMs for SM100 tensor cores: operand preparation for the block-scaled kernels.

What it is for (k3-architecture.md §6.3): on Blackwell the GEMMs of `model.ops.mx_linear` run on
e4m3 data with e8m0 scales instead of fake-quantised floats. This module turns high-precision
operands into exactly the arguments those kernels take:
- dense: `torch._scaled_mm(a_q [P, C], b_q^T [C, Q], blocked scales)`;
- grouped 2d x 3d (expert fprop and dgrad): `F.scaled_grouped_mm(x_q [S', C], w_q^T [G, C, Q],
  offs)` with the token groups along the rows of x;
- grouped 2d x 2d (expert wgrad): `F.scaled_grouped_mm(dy_q^T [N, S'], x_q [S', K], offs)` with
  the token groups along the contraction, giving [G, N, K].

Scales use cuBLAS's block-scaling layout: a scale matrix [rows, C/32] is padded to (128, 4)
tiles and each tile is stored as 32 x 16 bytes, element (r, c) at byte
    ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4.
For grouped operands every group is its own scale matrix (tiles never straddle two groups), and
the groups' blocked matrices follow each other, as the kernels expect.

Token groups take the flat view of `model.ops.token_groups.TokenGroups` (align 32): group g
starts at a multiple of 32 and takes max(32, round_up(size_g, 32)) rows (an empty group gets 32
zero rows, so no group has size 0), so the wgrad's 32-token blocks start at every group's first
token. All buffers are sized by bounds from the shapes alone (S + 32 G rows), so nothing here
syncs with the host. The matching
emulated path is `model.ops.mx_linear`; tests/unit/test_mx_native.py checks this module against
an independent emulator of the kernels' documented contract. Unverified on hardware (no SM100).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.ops.mx import BLOCK_SIZE, mx_quantize, pad_to_block
from model.ops.token_groups import TokenGroups, round_up

TILE_ROWS, TILE_COLS = 128, 4


def _blocked_offset(r: torch.Tensor, c: torch.Tensor,
                    col_tiles: int | torch.Tensor) -> torch.Tensor:
    """Byte offset of scale (r, c) inside one blocked scale matrix with `col_tiles` tiles a row."""
    tile = (r // TILE_ROWS) * col_tiles + c // TILE_COLS
    return tile * 512 + (r % 32) * 16 + ((r % TILE_ROWS) // 32) * 4 + c % TILE_COLS


def blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS block-scaling layout of e8m0 scale matrices [..., rows, cols] (cols = K/32), each
    matrix on its own: returns [..., blocked bytes]."""
    *batch, rows, cols = scales.shape
    col_tiles = round_up(cols, TILE_COLS) // TILE_COLS
    per = round_up(rows, TILE_ROWS) * col_tiles * TILE_COLS
    flat = scales.reshape(-1, rows * cols).view(torch.uint8)  # [B, rows*cols]
    out = torch.zeros(flat.shape[0], per, dtype=torch.uint8, device=scales.device)
    r = torch.arange(rows, device=scales.device).unsqueeze(1)
    c = torch.arange(cols, device=scales.device).unsqueeze(0)
    out[:, _blocked_offset(r, c, col_tiles).flatten()] = flat
    return out.view(torch.float8_e8m0fnu).reshape(*batch, per)


def row_group_scales(groups: TokenGroups, scale: torch.Tensor) -> torch.Tensor:
    """Scales [capacity, cols] of a groups-along-rows operand (flat view of `groups`) -> the
    groups' blocked matrices one after another, [sum_g round_up(padded_g, 128) (bound),
    round_up(cols, 4)]."""
    cols = scale.shape[1]
    col_tiles = round_up(cols, TILE_COLS) // TILE_COLS
    rows_blocked = round_up(groups.padded, TILE_ROWS)  # [G]
    base = (torch.cumsum(rows_blocked, 0) - rows_blocked) * col_tiles * TILE_COLS  # [G]
    cap_rows = round_up(groups.capacity + (TILE_ROWS - BLOCK_SIZE) * groups.G, TILE_ROWS)
    i = torch.arange(groups.capacity, device=scale.device)
    g = torch.searchsorted(groups.ends, i, right=True)  # [capacity]; G past the last group
    gc = g.clamp(max=groups.G - 1)
    r = (i - groups.starts[gc]).unsqueeze(1)
    c = torch.arange(cols, device=scale.device).unsqueeze(0)
    idx = base[gc].unsqueeze(1) + _blocked_offset(r, c, col_tiles)
    return _scatter_bytes(scale, idx, (g < groups.G).unsqueeze(1),
                          cap_rows * col_tiles * TILE_COLS).view(cap_rows, -1)


def col_group_scales(groups: TokenGroups, scale: torch.Tensor) -> torch.Tensor:
    """Scales [rows, capacity/32] of a groups-along-the-contraction operand (wgrad) -> the
    groups' blocked matrices one after another, [round_up(rows, 128), bound]."""
    rows = scale.shape[0]
    rows_blocked = round_up(rows, TILE_ROWS)
    cols_blocked = round_up(groups.padded // BLOCK_SIZE, TILE_COLS)  # [G]
    base = (torch.cumsum(cols_blocked, 0) - cols_blocked) * rows_blocked  # [G]
    cap_cols = round_up(groups.capacity // BLOCK_SIZE + (TILE_COLS - 1) * groups.G, TILE_COLS)
    j = torch.arange(groups.capacity // BLOCK_SIZE, device=scale.device)
    g = torch.searchsorted(groups.ends // BLOCK_SIZE, j, right=True)
    gc = g.clamp(max=groups.G - 1)
    c = (j - groups.starts[gc] // BLOCK_SIZE).unsqueeze(0)
    r = torch.arange(rows, device=scale.device).unsqueeze(1)
    col_tiles = cols_blocked[gc].unsqueeze(0) // TILE_COLS  # [1, n]: per column's group
    idx = base[gc].unsqueeze(0) + _blocked_offset(r, c, col_tiles)
    return _scatter_bytes(scale, idx, (g < groups.G).unsqueeze(0),
                          rows_blocked * cap_cols).view(rows_blocked, cap_cols)


def _scatter_bytes(scale: torch.Tensor, idx: torch.Tensor, live: torch.Tensor,
                   size: int) -> torch.Tensor:
    """Zeros[size] with scale's bytes written at idx where `live`; the others land in one spare
    byte that is cut off (masking by index, not by boolean selection, avoids a host sync)."""
    out = torch.zeros(size + 1, dtype=torch.uint8, device=scale.device)
    out[torch.where(live, idx, size).flatten()] = scale.view(torch.uint8).reshape(-1)
    return out[:size].view(torch.float8_e8m0fnu)


def _quantize_rows(t: torch.Tensor, mode: str, row_multiple: int) -> tuple[torch.Tensor, ...]:
    """t [..., P, C] -> (e4m3 [..., P', C'], e8m0 scales [..., P', C'/32]): C padded to 32 and P
    to `row_multiple` with zeros, blocked along C (the contraction)."""
    t = pad_to_block(pad_to_block(t.contiguous(), BLOCK_SIZE, -1)[0], row_multiple, -2)[0]
    return mx_quantize(t, BLOCK_SIZE, -1, mode)


def native_mm_nt(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a [P, C] @ b [Q, C]^T, both MXFP8 along C, on SM100 tensor cores; bf16 [P, Q] out."""
    P, Q = a.shape[0], b.shape[0]
    qa, sa = _quantize_rows(a, mode, TILE_ROWS)
    qb, sb = _quantize_rows(b, mode, TILE_ROWS)
    y = torch._scaled_mm(qa, qb.t(), blocked_scales(sa), blocked_scales(sb),
                         out_dtype=torch.bfloat16)  # [P', Q']
    return y[:P, :Q]


def _grouped_mm(a_q, a_s, b_q_t, b_s, offs) -> torch.Tensor:
    return F.scaled_grouped_mm(
        a_q, b_q_t, a_s, F.ScalingType.BlockWise1x32, b_s, F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        offs=offs, output_dtype=torch.bfloat16)


def native_grouped_nt(x_pad: torch.Tensor, w: torch.Tensor, layout: TokenGroups,
                      mode: str) -> torch.Tensor:
    """Expert fprop/dgrad: out[rows of g] = x_pad[rows of g] @ w[g]^T, MXFP8 along C.

    x_pad: [capacity, C] in `layout`; w: [G, Q, C]. Returns bf16 [capacity, Q]
    (padding rows are left as the kernel writes them; `layout.gather` drops them).
    """
    Q = w.shape[1]
    xq, xs = _quantize_rows(x_pad, mode, 1)  # rows already 32-aligned per group
    wq, ws = _quantize_rows(w, mode, TILE_ROWS)  # [G, Q', C'], [G, Q', C'/32]
    y = _grouped_mm(xq, row_group_scales(layout, xs), wq.transpose(-2, -1), blocked_scales(ws),
                    layout.offs)
    return y[:, :Q]


def native_grouped_wgrad(dy_pad: torch.Tensor, x_pad: torch.Tensor, layout: TokenGroups,
                         mode: str) -> torch.Tensor:
    """Expert wgrad: dW[g] = dy_pad[rows of g]^T @ x_pad[rows of g], MXFP8 along the tokens.

    dy_pad: [capacity, N], x_pad: [capacity, K] in `layout` (zero padding rows). Each group's
    32-token blocks start at its first token. Returns bf16 [G, N, K].
    """
    N, K = dy_pad.shape[1], x_pad.shape[1]
    dq, ds = _quantize_rows(dy_pad.t(), mode, TILE_ROWS)  # [N', capacity], blocked along tokens
    xq, xs = _quantize_rows(x_pad.t(), mode, TILE_ROWS)  # [K', capacity]
    dw = _grouped_mm(dq, col_group_scales(layout, ds), xq.t(), col_group_scales(layout, xs),
                     layout.offs)  # [G, N', K']
    return dw[:, :N, :K]

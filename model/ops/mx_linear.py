"""MXFP8 GEMMs for training: a dense linear and the grouped (per-expert) variant.

What it is for (k3-architecture.md §6.2): every GEMM quantises both operands to MXFP8 along its
own contraction axis, so X, W and dY each get two independently quantised copies:
    fprop  Y  = Q_K(X) · Q_K(W)^T        X [M, K] rowwise, W [N, K] along K
    dgrad  dX = Q_N(dY) · Q_N(W)         dY along N, W columnwise (dim 0 of [N, K])
    wgrad  dW = Q_M(dY)^T · Q_M(X)       both along the tokens M (leading dims of x flattened)
`wgrad_hp=True` runs the wgrad GEMM on unquantised dY and X (torchao MXFP8_RCEIL_WGRAD_WITH_HP).

Backends (`mx_backend`, logged once per device): "emulated" everywhere but SM100+ (fake-quantise
with `model.ops.mx`, then a float32 GEMM; bf16 on CUDA, where cuBLAS accumulates in fp32), MX-exact
up to accumulation order; "native" on SM100+, where the linears' three GEMMs run as
`torch._scaled_mm` on e4m3 data with e8m0 scales in cuBLAS's blocked layout (`to_blocked_scales`)
and a bf16 output. The native path is unverified here (no Blackwell machine); grouped expert
GEMMs stay emulated on every device.

Sizes that are not multiples of 32 along a quantised axis are zero-padded inside (see
`pad_to_block`): zeros do not change a block's amax, so the real elements quantise as a partial
block, and zero rows/columns add nothing to a GEMM. For the grouped wgrad each expert's tokens are
blocked on their own: the function pads every group to a multiple of 32 rows internally, so
callers may pass any group sizes (including 0). Deliberately not here: bias, module swapping
(another layer's job), MXFP4 weights, saving quantised copies to cut activation memory.
"""

from __future__ import annotations

import functools
import logging

import torch

from model.ops.grouped_gemm import grouped_mm
from model.ops.mx import BLOCK_SIZE, MODES, fake_quantize_mx, mx_quantize, pad_to_block

log = logging.getLogger("k3train.mx")


@functools.cache
def _backend_for(device_type: str, index: int | None) -> str:
    native = False
    if device_type == "cuda" and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(index)
        native = major >= 10 and hasattr(torch, "_scaled_mm") and hasattr(
            torch, "float8_e8m0fnu"
        )
    if native:
        log.info("MXFP8 on %s:%s: native block-scaled torch._scaled_mm for linears (grouped "
                 "expert GEMMs stay emulated)", device_type, index)
        return "native"
    log.info("MXFP8 on %s:%s: emulated backend (fake-quantise + GEMM)", device_type, index)
    return "emulated"


def mx_backend(device: torch.device | str) -> str:
    """"native" on CUDA SM100+ with e8m0 `_scaled_mm` support, else "emulated" (logged once)."""
    device = torch.device(device)
    return _backend_for(device.type, device.index)


def _fq(t: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """Fake-quantise along `dim`, zero-padding a partial last block (same shape and dtype out)."""
    padded, n = pad_to_block(t, BLOCK_SIZE, dim)
    return fake_quantize_mx(padded, dim, mode, BLOCK_SIZE).narrow(dim, 0, n)


def to_blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS block-scaling layout of an e8m0 scale matrix [rows, cols] (cols = K/32): padded to
    (128, 4) tiles, each tile stored as 32 x 16 (4 interleaved 32-row bands), flattened."""
    rows, cols = scale.shape
    R, C = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(R * 128, C * 4, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = scale.view(torch.uint8)
    tiles = padded.view(R, 128, C, 4).permute(0, 2, 1, 3)  # [R, C, 128, 4]
    out = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)  # [R*C, 32, 16]
    return out.flatten().view(torch.float8_e8m0fnu)


def _native_mm_nt(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a [P, C] @ b [Q, C]^T with both operands MXFP8 along C, on SM100 tensor cores."""
    P, Q = a.shape[0], b.shape[0]

    def prep(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, _ = pad_to_block(t.contiguous(), BLOCK_SIZE, -1)  # C -> multiple of 32
        t = torch.nn.functional.pad(t, (0, 0, 0, (-t.shape[0]) % 128))  # rows -> multiple of 128
        data, scale = mx_quantize(t, BLOCK_SIZE, -1, mode)
        return data, to_blocked_scales(scale)

    (qa, sa), (qb, sb) = prep(a), prep(b)
    y = torch._scaled_mm(qa, qb.t(), sa, sb, out_dtype=torch.bfloat16)  # [P', Q']
    return y[:P, :Q]


def _mm_nt(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a [P, C] @ b [Q, C]^T, both quantised along their own last dim C (the contraction).

    Every MX GEMM of a linear is this one primitive: fprop (x, w), dgrad (dy, w^T) and wgrad
    (dy^T, x^T), so each operand is blocked along the axis its GEMM sums over.
    """
    if a.device.type == "cuda" and mx_backend(a.device) == "native":
        return _native_mm_nt(a, b, mode).to(a.dtype)
    return _fq(a, -1, mode) @ _fq(b, -1, mode).T


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown MX scale mode {mode!r}; expected one of {MODES}")


def _compute_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    dtype = torch.promote_types(a.dtype, b.dtype)
    if dtype in (torch.bfloat16, torch.float16) and a.device.type != "cuda":
        return torch.float32  # fp16 matmul on CPU is ~800x slower; accumulate in fp32 anyway
    return dtype


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wgrad_hp: bool, mode: str):
        cdt = _compute_dtype(x, weight)
        x2 = x.reshape(-1, x.shape[-1]).to(cdt)  # [M, K]
        w = weight.to(cdt)  # [N, K]
        y = _mm_nt(x2, w, mode)  # [M, N], contraction over K
        ctx.save_for_backward(x2, w)
        ctx.wgrad_hp, ctx.mode = wgrad_hp, mode
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], w.shape[0]).to(torch.promote_types(x.dtype, weight.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w = ctx.saved_tensors  # [M, K], [N, K]
        mode = ctx.mode
        dy2 = dy.reshape(-1, w.shape[0]).to(x2.dtype)  # [M, N]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm_nt(dy2, w.T, mode)  # [M, K], contraction over N
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad_hp:
                dw = dy2.T @ x2  # [N, K]
            else:
                dw = _mm_nt(dy2.T, x2.T, mode)  # [N, K], contraction over M
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None


def mx_linear(
    x: torch.Tensor, weight: torch.Tensor, wgrad_hp: bool = False, mode: str = "rceil"
) -> torch.Tensor:
    """MXFP8 y = x @ weight.T. x: [..., K]; weight: [N, K] (nn.Linear layout) -> [..., N]."""
    _check_mode(mode)
    if x.shape[-1] != weight.shape[-1] or weight.ndim != 2:
        raise ValueError(f"mx_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ")
    mx_backend(x.device)  # logs the backend once per device
    return _MXLinear.apply(x, weight, wgrad_hp, mode)


def _group_layout(group_sizes: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row r of group g -> slot (g, r) in a [G, R, ...] buffer, R = max size rounded up to 32."""
    sizes = group_sizes.to(torch.long)
    G = sizes.shape[0]
    rows = torch.arange(G, device=sizes.device)
    group_of_row = torch.repeat_interleave(rows, sizes, output_size=S)  # [S]
    starts = torch.cumsum(sizes, 0) - sizes  # [G]
    row_in_group = torch.arange(S, device=sizes.device) - starts[group_of_row]  # [S]
    max_rows = int(sizes.max().item()) if G > 0 else 0
    return group_of_row, row_in_group, max_rows + (-max_rows % BLOCK_SIZE)


def _scatter_groups(t: torch.Tensor, layout: tuple, G: int) -> torch.Tensor:
    group_of_row, row_in_group, R = layout
    out = t.new_zeros(G, R, t.shape[-1])  # [G, R, D]: zero rows pad every group
    return out.index_put((group_of_row, row_in_group), t)


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_sizes, wgrad_hp: bool, mode: str):
        cdt = _compute_dtype(x, w)
        xc, wc = x.to(cdt), w.to(cdt)  # [S, K], [G, N, K]
        y = grouped_mm(_fq(xc, -1, mode), _fq(wc, -1, mode), group_sizes)  # [S, N] over K
        ctx.save_for_backward(xc, wc, group_sizes)
        ctx.wgrad_hp, ctx.mode, ctx.x_dtype, ctx.w_dtype = wgrad_hp, mode, x.dtype, w.dtype
        return y.to(torch.promote_types(x.dtype, w.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xc, wc, group_sizes = ctx.saved_tensors
        mode = ctx.mode
        dy = dy.to(xc.dtype).contiguous()  # [S, N]
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX_g = dY_g · W_g, contraction over N
            w_t = _fq(wc, 1, mode).transpose(1, 2).contiguous()  # [G, K, N]
            dx = grouped_mm(_fq(dy, -1, mode), w_t, group_sizes).to(ctx.x_dtype)  # [S, K]
        if ctx.needs_input_grad[1]:  # dW_g = dY_g^T · X_g, contraction over group g's tokens
            G = wc.shape[0]
            layout = _group_layout(group_sizes, xc.shape[0])
            dy_g = _scatter_groups(dy, layout, G)  # [G, R, N]
            x_g = _scatter_groups(xc, layout, G)  # [G, R, K]
            if not ctx.wgrad_hp:  # blocks of 32 tokens start at each group's first row
                dy_g, x_g = _fq(dy_g, 1, mode), _fq(x_g, 1, mode)
            dw = torch.bmm(dy_g.transpose(1, 2), x_g).to(ctx.w_dtype)  # [G, N, K]
        return dx, dw, None, None, None


def mx_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    group_sizes: torch.Tensor,
    wgrad_hp: bool = False,
    mode: str = "rceil",
) -> torch.Tensor:
    """MXFP8 grouped GEMM: y[rows of group g] = x[rows of g] @ w[g].T.

    x: [S, K] rows sorted by group; w: [G, N, K]; group_sizes: [G] ints summing to S (any sizes,
    0 allowed: groups are padded to 32 tokens inside for the wgrad). Returns [S, N].
    fprop and dgrad use `grouped_mm`; the wgrad (a contraction over tokens, which `grouped_mm`
    cannot express) is one bmm over the [G, R, .] padded group layout (one host sync for R).
    """
    _check_mode(mode)
    if w.ndim != 3 or x.shape[-1] != w.shape[-1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"mx_grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"group_sizes {tuple(group_sizes.shape)} do not fit"
        )
    mx_backend(x.device)
    return _MXGroupedMM.apply(x, w, group_sizes, wgrad_hp, mode)

"""MXFP8 GEMMs for training: a dense linear and the grouped (per-expert) variant.

What it is for (k3-architecture.md §6.2): every GEMM quantises both operands to MXFP8 along its
own contraction axis, so X, W and dY each get two independently quantised copies:
    fprop  Y  = Q_K(X) · Q_K(W)^T        X [M, K] rowwise, W [N, K] along K
    dgrad  dX = Q_N(dY) · Q_N(W)         dY along N, W columnwise (dim 0 of [N, K])
    wgrad  dW = Q_M(dY)^T · Q_M(X)       both along the tokens M (leading dims of x flattened)
`wgrad_hp=True` runs the wgrad GEMM on unquantised dY and X (torchao MXFP8_RCEIL_WGRAD_WITH_HP).

Backends (`mx_backend`, logged once per device): "emulated" everywhere but SM100+ (fake-quantise
with `model.ops.mx`, then a float32 GEMM; bf16 on CUDA, where cuBLAS accumulates in fp32), MX-exact
up to accumulation order; "native" on SM100+, where the three GEMMs run on e4m3 data with e8m0
scales in cuBLAS's blocked layout and a bf16 output: `torch._scaled_mm` for linears,
`F.scaled_grouped_mm` for the experts, each only when the torch build has the kernel and a
one-time probe (`probe_native`) agrees with the emulation.
Operand preparation lives in `model.ops.mx_native`; it is checked against an emulator of
the kernels' contract on CPU, but unverified on hardware (no Blackwell machine here).
`K3_MX_BACKEND=emulated|native` forces a backend.

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
import os

import torch

from model.ops import mx_native
from model.ops.backends import compile_constant
from model.ops.grouped_gemm import grouped_mm, grouped_mm_backend, grouped_mm_wgrad
from model.ops.mx import BLOCK_SIZE, MODES, as_dtype, fake_quantize_mx, pad_to_block
from model.ops.token_groups import TokenGroups

log = logging.getLogger("k3train.mx")


BACKENDS = ("emulated", "native")


def _native_capability(device_type: str, index: int | None, grouped: bool) -> str:
    """Why this device and torch build cannot run native MX GEMMs ("" if they might)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 10:
        return f"SM{major}{minor} has no MX tensor cores (SM100+ does)"
    if not (hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e8m0fnu")):
        return f"torch {torch.__version__} lacks e8m0 block-scaled _scaled_mm"
    if grouped and not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        return f"torch {torch.__version__} lacks F.scaled_grouped_mm"
    return ""


def probe_native(device: torch.device | str, grouped: bool) -> str:
    """Run the native kernels once on a small problem (uneven and empty expert groups; fprop and
    wgrad for the grouped kind) and compare with the emulation: "" when they agree to bf16
    output rounding, else why not. A kernel missing from the torch build (the MX grouped GEMM
    needs FBGEMM GenAI) or one that disagrees leaves the emulation in charge."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG alone

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    try:
        if grouped:
            sizes = torch.tensor([20, 0, 44], device=device)
            x, w, dy = rnd(64, 64), rnd(3, 48, 64), rnd(64, 48)
            layout = TokenGroups(sizes, 64)
            got = [layout.gather(mx_native.native_grouped_nt(layout.scatter(x), w, layout,
                                                             "rceil")),
                   mx_native.native_grouped_wgrad(layout.scatter(dy), layout.scatter(x), layout,
                                                  "rceil")]
            want = [grouped_mm(_fq(x, -1, "rceil"), _fq(w, -1, "rceil"), sizes),
                    _padded_group_wgrad(dy, x, sizes, "rceil")]
        else:
            a, b = rnd(64, 96), rnd(40, 96)
            got = [mx_native.native_mm_nt(a, b, "rceil")]
            want = [_fq(a, -1, "rceil") @ _fq(b, -1, "rceil").T]
    except Exception as e:  # noqa: BLE001 - any failure means "use the emulation"
        return f"native probe failed: {type(e).__name__}: {e}"[:300]
    for g, r in zip(got, want, strict=True):
        err = float((g.double() - r.double()).norm() / r.double().norm())
        if not err < 1e-2:
            return f"native probe disagrees with the emulation (relative error {err:.3g})"
    return ""


@functools.cache
def _backend_for(device_type: str, index: int | None, grouped: bool) -> str:
    forced = os.environ.get("K3_MX_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"K3_MX_BACKEND={forced!r}: expected one of {BACKENDS}")
        log.info("MXFP8 on %s:%s (%s GEMMs): %s backend (forced by K3_MX_BACKEND)", device_type,
                 index, "grouped" if grouped else "linear", forced)
        return forced
    why = _native_capability(device_type, index, grouped)
    if not why:
        why = probe_native(torch.device(device_type, index), grouped)
    native = not why
    kind = "grouped expert" if grouped else "linear"
    if native:
        log.info("MXFP8 on %s:%s (%s GEMMs): native block-scaled %s", device_type, index, kind,
                 "F.scaled_grouped_mm" if grouped else "torch._scaled_mm")
        return "native"
    log.info("MXFP8 on %s:%s (%s GEMMs): emulated backend (fake-quantise + GEMM): %s",
             device_type, index, kind, why)
    return "emulated"


@compile_constant  # compiled graphs take the (cached) choice as a constant
def mx_backend(device: torch.device | str, grouped: bool = False) -> str:
    """"native" on CUDA SM100+ when torch has the block-scaled kernel and a one-time probe
    (`probe_native`) agrees with the emulation, else "emulated"; logged once per device and GEMM
    kind. K3_MX_BACKEND forces a backend."""
    device = torch.device(device)
    return _backend_for(device.type, device.index, grouped)


def _fq(t: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """Fake-quantise along `dim`, zero-padding a partial last block (same shape and dtype out)."""
    padded, n = pad_to_block(t, BLOCK_SIZE, dim)
    return fake_quantize_mx(padded, dim, mode, BLOCK_SIZE).narrow(dim, 0, n)


def _mm_nt(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a [P, C] @ b [Q, C]^T, both quantised along their own last dim C (the contraction).

    Every MX GEMM of a linear is this one primitive: fprop (x, w), dgrad (dy, w^T) and wgrad
    (dy^T, x^T), so each operand is blocked along the axis its GEMM sums over.
    """
    if mx_backend(a.device) == "native":
        return mx_native.native_mm_nt(a, b, mode).to(a.dtype)
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
        return as_dtype(y.reshape(*x.shape[:-1], w.shape[0]),
                        torch.promote_types(x.dtype, weight.dtype))

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


def _padded_group_wgrad(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor,
                        quantise_mode: str | None) -> torch.Tensor:
    """dW_g = dY_g^T · X_g, optionally with both operands fake-quantised along the tokens in
    blocks of 32 that start at each group's first row (zero rows pad each group to 32).

    fp32/bf16: the flat 32-aligned view of `TokenGroups` (sized from shapes, no host sync) and
    one 2d x 2d grouped GEMM. float64 (verification): its [G, R, .] batched view and a bmm,
    whose R is read on the host."""
    groups = TokenGroups(group_sizes, x.shape[0])
    w_like = x.new_empty(0, dy.shape[1], x.shape[1])  # [G, N, K] strides for the backend check
    if grouped_mm_backend(x, w_like) == "grouped_mm":
        dy_p, x_p = groups.scatter(dy), groups.scatter(x)  # [capacity, N], [capacity, K]
        if quantise_mode is not None:
            dy_p, x_p = _fq(dy_p, 0, quantise_mode), _fq(x_p, 0, quantise_mode)
        return grouped_mm_wgrad(dy_p, x_p, groups.offs)  # [G, N, K]
    dy_g, x_g = groups.batched(dy), groups.batched(x)  # [G, R, N], [G, R, K]
    if quantise_mode is not None:
        dy_g, x_g = _fq(dy_g, 1, quantise_mode), _fq(x_g, 1, quantise_mode)
    return torch.bmm(dy_g.transpose(1, 2), x_g)  # [G, N, K]


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_sizes, wgrad_hp: bool, mode: str, native: bool):
        cdt = _compute_dtype(x, w)
        xc, wc = x.to(cdt), w.to(cdt)  # [S, K], [G, N, K]
        if native:
            layout = TokenGroups(group_sizes, xc.shape[0])
            y = layout.gather(mx_native.native_grouped_nt(layout.scatter(xc), wc, layout, mode))
        else:
            y = grouped_mm(_fq(xc, -1, mode), _fq(wc, -1, mode), group_sizes)  # [S, N] over K
        ctx.save_for_backward(xc, wc, group_sizes)
        ctx.wgrad_hp, ctx.mode, ctx.native = wgrad_hp, mode, native
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return as_dtype(y, torch.promote_types(x.dtype, w.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xc, wc, group_sizes = ctx.saved_tensors
        mode = ctx.mode
        dy = dy.to(xc.dtype).contiguous()  # [S, N]
        dx = dw = None
        quantised_wgrad = ctx.needs_input_grad[1] and not ctx.wgrad_hp
        if ctx.native:
            layout = TokenGroups(group_sizes, xc.shape[0])
            dy_pad = layout.scatter(dy)
            if ctx.needs_input_grad[0]:  # contraction over N: w^T as [G, K, N]
                w_t = wc.transpose(1, 2).contiguous()
                dx = layout.gather(mx_native.native_grouped_nt(dy_pad, w_t, layout, mode))
            if quantised_wgrad:
                dw = mx_native.native_grouped_wgrad(dy_pad, layout.scatter(xc), layout, mode)
        else:
            if ctx.needs_input_grad[0]:  # dX_g = dY_g · W_g, contraction over N
                w_t = _fq(wc, 1, mode).transpose(1, 2).contiguous()  # [G, K, N]
                dx = grouped_mm(_fq(dy, -1, mode), w_t, group_sizes)  # [S, K]
            if quantised_wgrad:  # dW_g = dY_g^T · X_g, contraction over group g's tokens
                dw = _padded_group_wgrad(dy, xc, group_sizes, mode)
        if ctx.needs_input_grad[1] and ctx.wgrad_hp:
            dw = _padded_group_wgrad(dy, xc, group_sizes, None)
        dx = None if dx is None else dx.to(ctx.x_dtype)
        dw = None if dw is None else dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None


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
    Emulated: fprop and dgrad use `grouped_mm`; the wgrad (a contraction over tokens, which
    `grouped_mm` cannot express) is one 2d x 2d grouped GEMM over the flat 32-aligned view of
    `TokenGroups` (a bmm over its batched view in float64). Native (SM100): all three are
    `F.scaled_grouped_mm` over the flat view.
    """
    _check_mode(mode)
    if w.ndim != 3 or x.shape[-1] != w.shape[-1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"mx_grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"group_sizes {tuple(group_sizes.shape)} do not fit"
        )
    native = mx_backend(x.device, grouped=True) == "native"
    return _MXGroupedMM.apply(x, w, group_sizes, wgrad_hp, mode, native)

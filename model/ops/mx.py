"""MXFP8 (OCP MX v1.0) block quantisation: E4M3 elements with one E8M0 scale per 32 elements.

What it is for (k3-architecture.md §6.1, §6.5): the reference quantiser behind the emulated MXFP8
GEMMs (`model.ops.mx_linear`) and the test oracle for any fast kernel. Blocks are 32 consecutive
elements along one axis `dim`; every function is vectorised (no Python loop over blocks).

Scale exponent e (the block's scale is 2^e, stored as the biased byte e + 127):
- "rceil" (default; cuBLAS/TE/torchao training): the smallest e with amax / 2^e <= 448, i.e.
  ceil(log2(amax / 448)), computed exactly from the float bits with `torch.frexp` (amax = m·2^p,
  m in [0.5, 1): e = p - 9, plus 1 when m > 0.875). amax = 448·2^k gives e = k, never k + 1, which
  a float log2 of a rounded quotient can get wrong.
- "floor" (OCP MX v1.0 spec): e = floor(log2 amax) - 8 = p - 9. Elements of a block whose amax
  mantissa exceeds 1.75 then saturate to ±448.
e is clamped to the E8M0 range [-127, 127]. Elements: clamp(x / 2^e, -448, 448) cast to e4m3 with
round-to-nearest-even (the clamp comes first: casts in torch <= 2.11 did not saturate).

Special blocks (the choices follow torchao's `_to_mx_rceil` except where noted):
- all-zero block: scale byte 0x00 (2^-127), data zeros (the sign of -0.0 is kept, byte 0x80).
- block containing a NaN: scale byte 0xFF (NaN) and *every* element byte 0x7F (NaN). torchao
  keeps the finite elements; dequantisation is NaN either way, and all-NaN data is unambiguous.
- block whose amax is ±Inf (no NaN): scale byte 0xFE (2^127); ±Inf elements saturate to ±448 and
  the finite ones quantise against 2^127 (almost all flush to ±0). Dequantising gives back ±Inf
  (448·2^127 overflows float32) for the Inf elements.
- subnormal inputs: frexp is exact for them; the scale then clamps at 2^-127.

Backends: on CUDA (16/32-bit inputs, blocks of 32; and in fake-tensor traces under
`force_cuda_backends()`) `mx_quantize` and `fake_quantize_mx` run the custom op `k3::mx_cast`,
our Triton kernel (`model.ops.mx_triton`: one read, one write, bit-exact with the PyTorch
formulas here, which stay the oracle). `K3_MX_CAST_BACKEND=auto|torch|triton` overrides.
torchao's casts are not used: torchao is not a dependency of the GPU machine, and ours is
checked bit for bit against this module under TRITON_INTERPRET=1 in CI.

Deliberately not here: E5M2/FP6/FP4 elements, CEIL/EVEN modes, the cuBLAS 128x4 scale swizzle,
autograd through the quantised bytes. Arithmetic runs in float32 because CPU fp8 dtypes are
storage-only; float64 inputs are rounded to float32 first (torch's own float64 -> e4m3 cast goes
through float32 too, so it double-rounds).
"""

from __future__ import annotations

import torch

from model.ops.backends import triton_chosen, use_fused_kernel

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
MODES = ("rceil", "floor")


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, but `t` itself when it already has that dtype: under torch 2.11's dynamo an
    autograd.Function whose forward returns a no-op `.to` of an intermediate gets zero
    gradients (`tests/unit/test_mx.py::test_mx_gemms_compile_like_eager` on 2.11)."""
    return t if t.dtype == dtype else t.to(dtype)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown MX scale mode {mode!r}; expected one of {MODES}")


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact 2^k as float32 for integer k in [-127, 127], built from the bits (no exp2 rounding)."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23  # biased exponent field, k >= -126
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)  # k = -127: 2^22 · 2^-149
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def pad_to_block(
    x: torch.Tensor, block_size: int = BLOCK_SIZE, dim: int = -1
) -> tuple[torch.Tensor, int]:
    """Zero-pad `dim` of x up to a multiple of block_size. Returns (padded, original_size).

    Zeros never change a block's amax, so the real elements quantise exactly as they would in a
    partial block; slice the result back with `.narrow(dim, 0, original_size)`.
    """
    n = x.shape[dim]
    pad = -n % block_size
    if pad == 0:
        return x, n
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim), n


def mx_quantize(
    x: torch.Tensor, block_size: int = BLOCK_SIZE, dim: int = -1, mode: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x to MXFP8 along `dim`.

    Returns (data, scale): data float8_e4m3fn with x's shape; scale float8_e8m0fnu with shape
    x.shape but shape[dim] // block_size. Raises ValueError if shape[dim] % block_size != 0.
    """
    _check_mode(mode)
    if x.ndim == 0:
        raise ValueError("mx_quantize needs at least one dimension")
    dim = dim % x.ndim
    n = x.shape[dim]
    if n % block_size:
        raise ValueError(
            f"mx_quantize: dim {dim} of shape {tuple(x.shape)} has size {n}, not a multiple of "
            f"block_size={block_size}; pad first with pad_to_block(x, {block_size}, dim={dim}) "
            f"and slice the result back"
        )
    if _cast_fused(x, block_size):
        q, sc = _mx_cast_op(x.detach().contiguous(), dim, mode == "floor", False)
        return q.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu)
    return _mx_quantize_reference(x, block_size, dim, mode)


def _mx_quantize_reference(x: torch.Tensor, block_size: int, dim: int, mode: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mx_quantize` in PyTorch ops (the oracle of the kernel)."""
    n = x.shape[dim]
    xf = x.detach().movedim(dim, -1).to(torch.float32)  # [..., n]
    xb = xf.reshape(*xf.shape[:-1], n // block_size, block_size)  # [..., B, 32]
    has_nan = xb.isnan().any(-1)  # [..., B]
    amax = torch.where(has_nan, 0.0, xb.abs().amax(-1))  # [..., B]
    is_inf = amax.isinf()
    mant, p = torch.frexp(torch.where(is_inf, 1.0, amax))  # amax = mant · 2^p, mant in [0.5, 1)
    e = p - 9  # floor(log2 amax) - emax(e4m3) = (p - 1) - 8
    if mode == "rceil":
        e = e + (mant > 0.875).to(torch.int32)  # amax > 1.75 · 2^(p-1) needs one more power
    e = torch.where(is_inf, E8M0_BIAS, e)
    e = torch.where(amax == 0, -E8M0_BIAS, e).clamp(-E8M0_BIAS, E8M0_BIAS)  # [..., B] int32

    scaled = xb * _pow2(-e).unsqueeze(-1)  # exact: power-of-two multiply
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # RNE, saturated
    q_bytes = torch.where(has_nan.unsqueeze(-1), E4M3_NAN, q.view(torch.uint8)).to(torch.uint8)
    s_bytes = torch.where(has_nan, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8)

    data = q_bytes.reshape(xf.shape).movedim(-1, dim).contiguous().view(torch.float8_e4m3fn)
    scale = s_bytes.movedim(-1, dim).contiguous().view(torch.float8_e8m0fnu)
    return data, scale


_ENV = "K3_MX_CAST_BACKEND"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cast_fused(x: torch.Tensor, block_size: int) -> bool:
    """Whether the cast runs as `k3::mx_cast` (our Triton kernel on CUDA)."""
    return (block_size == BLOCK_SIZE and x.dtype in _KERNEL_DTYPES and x.ndim > 0
            and use_fused_kernel(x, _ENV))


@torch.library.custom_op("k3::mx_cast", mutates_args=())
def _mx_cast_op(x: torch.Tensor, dim: int, floor: bool, fake: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes as uint8, or with ``fake`` the dequantised values in x's dtype; e8m0 scale
    bytes as uint8) of contiguous x, blocks of 32 along `dim` (a multiple of 32 long)."""
    mode = "floor" if floor else "rceil"
    if triton_chosen(x, _ENV):
        from model.ops import mx_triton

        return mx_triton.mx_cast(x, dim, floor, fake)
    data, scale = _mx_quantize_reference(x, BLOCK_SIZE, dim, mode)  # forced off CUDA
    if fake:
        return mx_dequantize(data, scale, BLOCK_SIZE, dim, x.dtype), scale.view(torch.uint8)
    return data.view(torch.uint8), scale.view(torch.uint8)


@_mx_cast_op.register_fake
def _(x, dim, floor, fake):
    d = dim % x.ndim
    s_shape = (*x.shape[:d], x.shape[d] // BLOCK_SIZE, *x.shape[d + 1:])
    q = torch.empty_like(x) if fake else x.new_empty(x.shape, dtype=torch.uint8)
    return q, x.new_empty(s_shape, dtype=torch.uint8)


def mx_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    dim: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """data · 2^e with each scale broadcast over its block along `dim` (NaN scale -> NaN)."""
    dim = dim % data.ndim
    if scale.shape[dim] * block_size != data.shape[dim]:
        raise ValueError(
            f"mx_dequantize: scale shape {tuple(scale.shape)} does not match data shape "
            f"{tuple(data.shape)} with block_size={block_size} along dim {dim}"
        )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    s_bytes = scale.view(torch.uint8).to(torch.int32)
    s = _pow2((s_bytes - E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)).to(compute)
    s = torch.where(s_bytes == E8M0_NAN, float("nan"), s).movedim(dim, -1)  # [..., B]
    d = data.movedim(dim, -1).to(compute)  # [..., n] (fp8 is storage-only: upcast first)
    db = d.reshape(*d.shape[:-1], s.shape[-1], block_size) * s.unsqueeze(-1)  # [..., B, 32]
    return as_dtype(db.reshape(d.shape).movedim(-1, dim), dtype)


def _fake_quantize(x: torch.Tensor, block_size: int, dim: int, mode: str) -> torch.Tensor:
    if _cast_fused(x, block_size) and x.shape[dim % x.ndim] % block_size == 0:
        return _mx_cast_op(x.detach().contiguous(), dim % x.ndim, mode == "floor", True)[0]
    data, scale = mx_quantize(x, block_size, dim, mode)
    return mx_dequantize(data, scale, block_size, dim, dtype=x.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """Fake quantisation with a straight-through (identity) gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block_size: int, dim: int, mode: str) -> torch.Tensor:
        return _fake_quantize(x, block_size, dim, mode)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


def fake_quantize_mx(
    x: torch.Tensor, dim: int = -1, mode: str = "rceil", block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Quantise to MXFP8 along `dim` and dequantise back to x's dtype (the emulation primitive).

    Differentiable with a straight-through gradient (identity), the usual QAT convention; the
    MXFP8 GEMMs in `model.ops.mx_linear` quantise their gradients themselves.
    """
    _check_mode(mode)
    if x.requires_grad and torch.is_grad_enabled():
        return _FakeQuantSTE.apply(x, block_size, dim, mode)
    return _fake_quantize(x, block_size, dim, mode)

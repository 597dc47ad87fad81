"""MXFP4 (OCP MX v1.0) dequantisation: Kimi K3's released routed-expert weights.

K3's release stores each routed expert's w1/w2/w3 in compressed-tensors' `mxfp4-pack-quantized`
format (k3-architecture.md §6.6): `weight_packed` uint8 [out, in/2], two E2M1 codes per byte (the
low nibble is the even column), and `weight_scale` uint8 [out, in/32], one E8M0 exponent per 32
consecutive input columns. A code's bit 3 is the sign and bits 0-2 index the magnitudes {0, 0.5, 1,
1.5, 2, 3, 4, 6}; the weight is value x 2^(scale - 127). Scale byte 255 is NaN (the OCP spec: E8M0
has no Inf), so a whole group decodes to NaN; byte 0 is 2^-127.

The result is exact in float32 and bfloat16: an E2M1 value has two significant bits, and the
smallest non-zero product, 0.5 x 2^-127, is a subnormal of both formats (their exponent ranges are
the same); only products of 2^128 or more (scale bytes 253-254 with |value| >= 4 or 2) overflow to
+-inf, as IEEE rounding has them. The scale is built from its float32 bits (not `exp2`), so no
library rounding enters. Vectorised over all groups; it runs once per tensor at import time, not in
training."""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class MXFP4Error(ValueError):
    """Packed and scale tensors that cannot belong together; one line."""


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., in/2] uint8 codes and [..., in/32] uint8 exponents -> [..., in] in `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"MXFP4 tensors must be uint8 (weight_packed {packed.dtype}, "
                         f"weight_scale {scale.dtype})")
    cols = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != cols:
        raise MXFP4Error(f"weight_scale {list(scale.shape)} does not fit weight_packed "
                         f"{list(packed.shape)}: expected [..., {cols // GROUP}] (one exponent "
                         f"per {GROUP} of its {cols} columns)")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                       device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)  # low nibble first
    values = lut[codes.long()]
    factor = _e8m0_to_float32(scale).repeat_interleave(GROUP, dim=-1)
    return (values * factor).to(dtype)


def _e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) from the float32 bit pattern: s << 23 for s in 1..254, 2^-127 (a subnormal,
    bits 0x00400000) for 0, NaN for 255."""
    bits = scale.to(torch.int32) << 23
    bits = torch.where(scale == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(scale == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)

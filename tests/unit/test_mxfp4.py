"""MXFP4 dequantisation (`model.ops.mxfp4`) against an oracle written here from the OCP MX v1.0
definitions (E2M1 sign / exponent / mantissa fields, E8M0 = 2^(s-127), 255 = NaN), element by
element in Python floats, and against the `compressed-tensors` package's own unpacking of its
`mxfp4-pack-quantized` format (the format of K3's released experts)."""

from __future__ import annotations

import math

import pytest
import torch

from model.ops.mxfp4 import MXFP4Error, dequantize_mxfp4
from tests.helpers.k3_release import ct_dequantize


def _e2m1(code: int) -> float:
    """OCP E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def _oracle(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, nbytes = packed.shape
    out = torch.empty(rows, nbytes * 2, dtype=torch.float64)
    for r in range(rows):
        for b in range(nbytes):
            byte = int(packed[r, b])
            for half, code in ((0, byte & 0xF), (1, byte >> 4)):  # even column: low nibble
                col = 2 * b + half
                s = int(scale[r, col // 32])
                factor = math.nan if s == 255 else 2.0 ** (s - 127)
                v = _e2m1(code) * factor
                # float32 and bfloat16 both overflow at 2^128 (two significant bits fit below)
                out[r, col] = math.copysign(math.inf, v) if abs(v) >= 2.0 ** 128 else v
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.double()
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def test_every_byte_and_special_scales_match_the_oracle():
    # every byte value (all 16 codes in both nibbles) under scales 0, 1, 126, 127, 128, 254, 255
    packed = torch.arange(256, dtype=torch.uint8).repeat(7, 1)  # [7, 256] -> 512 columns
    scale = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)[:, None].repeat(1, 16)
    scale[:, 1::2] = torch.tensor([127, 130, 0, 255, 1, 127, 3], dtype=torch.uint8)[:, None]
    want = _oracle(packed, scale)
    assert want.isnan().any() and (want == 0).any() and want.isinf().any()
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_mxfp4(packed, scale, dtype)
        assert got.dtype == dtype and got.shape == (7, 512)
        assert _same(got, want), dtype
    assert torch.equal(dequantize_mxfp4(packed, scale)[3, :16], torch.tensor(
        [0.0, 0.0, 0.5, 0.0, 1.0, 0.0, 1.5, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0, 0.0, 6.0, 0.0]))


def test_batched_experts_match_the_oracle():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 32), dtype=torch.uint8, generator=g)  # [E, out, in/2]
    scale = torch.randint(100, 150, (3, 5, 2), dtype=torch.uint8, generator=g)
    got = dequantize_mxfp4(packed, scale, torch.bfloat16)
    for e in range(3):
        assert _same(got[e], _oracle(packed[e], scale[e]))


def test_equals_compressed_tensors_unpacking():
    g = torch.Generator().manual_seed(1)
    for rows, cols in ((64, 128), (3, 64), (48, 256)):
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        scale = torch.randint(1, 255, (rows, cols // 32), dtype=torch.uint8, generator=g)
        theirs = ct_dequantize(packed, scale)
        ours = dequantize_mxfp4(packed, scale, theirs.dtype)
        assert theirs.shape == ours.shape == (rows, cols)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (rows, cols)


@pytest.mark.parametrize("packed, scale, match", [
    (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), "uint8"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), r"\[..., 1\]"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), "does not fit"),
])
def test_mismatched_tensors_are_one_line_errors(packed, scale, match):
    with pytest.raises(MXFP4Error, match=match) as e:
        dequantize_mxfp4(packed, scale)
    assert "\n" not in str(e.value)

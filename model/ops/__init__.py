"""Numeric ops: each has a pure-PyTorch reference (the test oracle) and fast backends by device.

The MXFP8 GEMMs live in `model.ops.mx_linear` (`mx_linear`, `mx_grouped_mm`).
"""

from model.ops.attnres import attnres_mix, attnres_weights
from model.ops.grouped_gemm import grouped_mm
from model.ops.kda import chunk_kda, recurrent_kda
from model.ops.mx import fake_quantize_mx, mx_dequantize, mx_quantize, pad_to_block
from model.ops.situ import situ_glu

__all__ = [
    "attnres_mix", "attnres_weights", "chunk_kda", "fake_quantize_mx", "grouped_mm",
    "mx_dequantize", "mx_quantize", "pad_to_block",
    "recurrent_kda", "situ_glu",
]

"""Numeric ops: each has a pure-PyTorch reference (the test oracle) and fast backends by device."""

from model.ops.attnres import attnres_mix, attnres_weights
from model.ops.grouped_gemm import grouped_mm
from model.ops.kda import chunk_kda, recurrent_kda
from model.ops.situ import situ_glu

__all__ = ["attnres_mix", "attnres_weights", "chunk_kda", "grouped_mm", "recurrent_kda", "situ_glu"]

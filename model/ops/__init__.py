"""Numeric ops: each has a pure-PyTorch reference (the test oracle) and fast backends by device.

The MXFP8 GEMMs live in `model.ops.mx_linear` (`mx_linear`, `mx_grouped_mm`). The fast
backends (library kernels, and our Triton kernels in `*_triton.py` for the AttnRes mix,
SiTU-GLU, the short conv, the row norms and the MoE combine) are `torch.library` custom ops
(`torch.ops.k3.*`) with fake implementations, registered on every machine, so fake-tensor
traces and torch.compile see one node each; `model.ops.backends.force_cuda_backends()` selects
them on any device. The KDA reference's chunk math is one too (`k3::kda_chunk`, with a
hand-written backward: `model.ops.kda_chunk`), so compiled CPU layers do not unroll its loops.

Host synchronisation: the GPU path syncs nowhere. `HOST_SYNC_OPS` lists the places that may
still read tensor data on the host, each because its CUDA path is a library kernel that needs
the value, or because it is a reference path that the GPU never takes.
"""

from model.ops.attnres import attnres_mix, attnres_weights
from model.ops.combine import weighted_combine
from model.ops.grouped_gemm import grouped_mm
from model.ops.kda import chunk_kda, recurrent_kda
from model.ops.mx import fake_quantize_mx, mx_dequantize, mx_quantize, pad_to_block
from model.ops.rms_norm import gated_rms_norm, l2_norm, rms_norm
from model.ops.short_conv import short_conv_silu
from model.ops.situ import situ_glu

HOST_SYNC_OPS = {
    "k3::chunk_kda_fla": "fla computes its chunk indices from cu_seqlens on the host unless "
                         "given cu_seqlens_cpu (the trainer's packing passes it)",
    "grouped_gemm._padded_bmm": "reference path (float64 verification, odd widths): one read "
                                "of the largest group (token_groups.TokenGroups.batched); "
                                "CUDA bf16 uses k3::grouped_mm",
    "mx_linear._padded_group_wgrad (float64)": "reference path of the emulated MXFP8 weight "
                                               "gradient in float64 only (TokenGroups.batched)",
    "short_conv._cross_doc_taps": "CPU path of k3::short_conv only (one nonzero finds the "
                                  "first K - 1 tokens of each document); CUDA runs our Triton "
                                  "kernel, fake-tensor traces the op's fake implementation",
}

__all__ = [
    "HOST_SYNC_OPS",
    "attnres_mix", "attnres_weights", "chunk_kda", "fake_quantize_mx",
    "gated_rms_norm", "grouped_mm", "l2_norm", "mx_dequantize", "mx_quantize", "pad_to_block",
    "recurrent_kda", "rms_norm", "short_conv_silu", "situ_glu", "weighted_combine",
]

"""Stage a (env): versions, the device, and the backend each fast op picks on it.

    python benchmarks/gpu/a_env.py [--device cuda]

Prints one JSON line: python / torch / CUDA / cuDNN / NCCL / triton / fla versions, the device
name, capability and memory; `kda_backend`, `attention_backend` (bf16), `grouped_mm_backend`
(bf16, K3 expert shape) and `mx_backend` (linear and grouped) on that device; which of the
project's imports are missing; whether fla's `chunk_kda` imports (and why not).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys

import gpu_common as common
import torch

MODULES = ("numpy", "yaml", "omegaconf", "hydra", "rich", "tokenizers", "safetensors", "einops",
           "packaging", "triton", "fla", "matplotlib", "pyarrow", "wandb", "torchao")


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(ctx: common.Ctx, out: dict) -> bool:
    dev = ctx.device
    out.update(python=platform.python_version(), torch=torch.__version__,
               torch_cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
               triton=version_of("triton"), fla_core=version_of("fla-core"),
               flash_linear_attention=version_of("flash-linear-attention"),
               hydra_core=version_of("hydra-core"), omegaconf=version_of("omegaconf"),
               numpy=version_of("numpy"), cuda_available=torch.cuda.is_available(),
               device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
               device_name=common.device_name(ctx))
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an import may fail in any way
            missing.append(f"{name} ({type(e).__name__})")
    out["missing_modules"] = missing
    if ctx.cuda:
        props = torch.cuda.get_device_properties(dev)
        out.update(capability=list(torch.cuda.get_device_capability(dev)),
                   total_mem_gib=round(props.total_memory / 2**30, 1),
                   sm_count=props.multi_processor_count,
                   cudnn=torch.backends.cudnn.version(),
                   bf16_supported=torch.cuda.is_bf16_supported())

        def nccl() -> str:
            v = torch.cuda.nccl.version()
            return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)

        common.attempt(out, "nccl", nccl)

    def fla_import() -> str:
        import fla
        from fla.ops.kda import chunk_kda  # noqa: F401 - does fla's KDA import here?
        return str(getattr(fla, "__version__", "?"))

    common.attempt(out, "fla_chunk_kda_import", fla_import)
    out.pop("failed", None)  # a missing fla is reported by kda_backend below, not a stage error

    from model.ops.grouped_gemm import grouped_mm_backend
    from model.ops.kda import kda_backend
    from model.ops.mx_linear import mx_backend

    def attn_backend() -> str:
        from model.ops.attention import attention_backend
        return attention_backend(dev, torch.bfloat16)

    x = torch.empty(8, 3584, dtype=torch.bfloat16, device=dev)
    w = torch.empty(2, 3072, 3584, dtype=torch.bfloat16, device=dev)
    backends: dict = {}
    common.attempt(backends, "kda", lambda: kda_backend(dev))
    common.attempt(backends, "attention_bf16", attn_backend)
    common.attempt(backends, "grouped_mm_bf16", lambda: grouped_mm_backend(x, w))
    common.attempt(backends, "mx_linear", lambda: mx_backend(dev))
    common.attempt(backends, "mx_grouped", lambda: mx_backend(dev, grouped=True))
    out["backends"] = backends
    out["has_grouped_mm"] = hasattr(torch, "_grouped_mm")
    try:
        from torch.nn.attention import varlen  # noqa: F401
        out["has_varlen_attn"] = True
    except ImportError:
        out["has_varlen_attn"] = False
    out["env"] = {k: os.environ.get(k) for k in (
        "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "K3TRAIN_CACHE", "K3_KDA_BACKEND",
        "K3_ATTN_BACKEND", "K3_GROUPED_MM_BACKEND", "K3_MX_BACKEND", "CUDA_VISIBLE_DEVICES")}
    out["deepspeed_imported"] = "deepspeed" in sys.modules
    failed = backends.get("failed", [])
    if ctx.cuda:  # what an H200 should pick
        want = {"kda": "fla", "attention_bf16": "varlen", "grouped_mm_bf16": "grouped_mm"}
        out["expected_backends"] = all(backends.get(k) == v for k, v in want.items())
    return not failed


if __name__ == "__main__":
    common.run_stage("env", main)

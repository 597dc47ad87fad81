"""Tiny model configs for unit tests (the `debug` preset and variations of it)."""

from __future__ import annotations

import dataclasses

import torch

from model.build import build_model
from model.config import ModelConfig, load_model_config


def debug_config(**overrides) -> ModelConfig:
    return dataclasses.replace(load_model_config("debug"), **overrides).validate()


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    model = build_model(debug_config(**overrides), seed=seed)
    return model.to(dtype) if dtype != torch.float32 else model


def packed_batch(batch: int = 2, seq: int = 64, seed: int = 0, vocab: int = 512):
    """(input_ids [B, T], labels [B, T], cu_seqlens): random tokens in several documents per
    row, one label ignored per document end, deterministic."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    starts = sorted({0, *torch.randint(1, seq, (3,), generator=gen).tolist()})
    cu = torch.tensor([r * seq + s for r in range(batch) for s in starts] + [batch * seq],
                      dtype=torch.int32)
    flat = labels.flatten()
    flat[cu[1:].long() - 1] = -100  # no target across a document end
    return ids, flat.view(batch, seq), cu


def fsdp_debug_pair(world: int, seed: int = 5, reshard_after_forward: bool = True,
                    param_dtype: str = "fp32"):
    """(the debug model FSDP2-sharded over `world` data ranks, the same model on one device),
    initialised alike; call inside a process group of `world` ranks. `param_dtype`: FSDP2's
    compute dtype (gradients reduced in fp32)."""
    from model.init import init_weights
    from parallel.dims import ParallelDims
    from parallel.fsdp import apply_fsdp, dtensor_writer
    from train.config import ParallelConfig

    mesh = ParallelDims.from_config(ParallelConfig(), world).build_meshes("cpu").dp
    sharded = build_model("debug", device="meta")
    apply_fsdp(sharded, mesh, param_dtype, reshard_after_forward=reshard_after_forward)
    sharded.to_empty(device="cpu")
    init_weights(sharded, seed=seed, write=dtensor_writer)
    return sharded, build_model("debug", seed=seed)


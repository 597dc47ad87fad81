"""Activation checkpointing per decoder layer (`full`) or per op (`selective`), and per-layer
`torch.compile`; both are numerics-neutral switches applied from outside the model.

`full` keeps only each layer's inputs and recomputes the layer in backward. `selective` keeps
the outputs of the expensive ops (matmuls, grouped GEMMs, attention, our `k3::` custom ops for
fla KDA, varlen attention and grouped GEMMs, collectives: recomputing
an all-to-all would repeat the communication) and recomputes the cheap elementwise work (norms,
gates, SiTU, AttnRes softmax). The router does not count Quantile-Balancing statistics during a
recompute (the custom op `k3::record_router_stats` checks `model.moe.in_recomputation` when it
runs, eager or compiled). Both wrap the layer's `forward` in place, so parameter
names, FSDP units and checkpoints are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

AC_MODES = ("none", "full", "selective")
CUSTOM_OPS_SAVED = ("chunk_kda_fla", "varlen_attention", "grouped_mm")


def _save_list() -> set:
    ops = torch.ops.aten
    names = [ops.mm.default, ops.addmm.default, ops.bmm.default, ops.linear.default,
             ops._scaled_dot_product_efficient_attention.default,
             ops._scaled_dot_product_flash_attention.default,
             ops._scaled_dot_product_flash_attention_for_cpu.default]
    for extra in ("_grouped_mm", "_scaled_mm"):
        if hasattr(ops, extra):
            names.append(getattr(ops, extra).default)
    import model.ops.attention  # noqa: F401  (registers the k3:: custom ops)
    import model.ops.grouped_gemm  # noqa: F401
    import model.ops.kda  # noqa: F401

    for name in CUSTOM_OPS_SAVED:  # our fast ops: one opaque node each, expensive to recompute
        op = getattr(torch.ops.k3, name, None)
        if op is not None:
            names.append(op.default)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None:
        for n in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                  "wait_tensor"):
            if hasattr(c10d, n):
                names.append(getattr(c10d, n).default)
    return set(names)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE)


_SAVE = _save_list()


def apply_activation_checkpointing(layers: list[nn.Module], mode: str) -> None:
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpoint mode {mode!r}: choose one of {AC_MODES}")
    if mode == "none":
        return
    for layer in layers:
        inner = layer.forward
        kw = {}
        if mode == "selective":
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy)

        @functools.wraps(inner)
        def forward(*args, _inner=inner, _kw=kw, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **_kw, **kwargs)

        layer.forward = forward


def apply_compile(layers: list[nn.Module], backend: str | Callable = "inductor") -> None:
    """Compile each decoder layer's forward (one graph per layer; dynamic shapes off).

    Every layer type traces as one graph (`tests/unit/test_graph_breaks.py`). All layers share
    one code object (`DecoderLayer.forward`), and dynamo keeps its compiled graphs per code
    object: layers that differ in attention type, FFN, block start or the number of AttnRes
    blocks they receive (a static shape) each need their own (24 for K3's 93 layers), so
    dynamo's default recompile limit (8) would leave most layers eager. The limits are raised
    to one graph per layer for each of training and evaluation (never lowered)."""
    cfg = torch._dynamo.config
    for name, need in (("recompile_limit", 2 * len(layers)),
                       ("accumulated_recompile_limit", 4 * len(layers))):
        name = name if hasattr(cfg, name) else name.replace("recompile", "cache_size")
        setattr(cfg, name, max(getattr(cfg, name), need))
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)

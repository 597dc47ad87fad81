"""Collect the arrays `train.observe.metrics.MetricsLogger.log_images` plots from a `K3Model`.

* `expert_load_matrix` / `router_bias_matrix`: the routers' `expert_load` and
  `e_score_correction_bias` buffers stacked [n_moe_layers, n_experts] (as numpy).
* `attnres_depth_weights`: one no-grad forward that records every Block-AttnRes mix's depth
  weights, averaged over tokens, as [n_mixes, max_sources] with row labels.

Deliberately does not: reduce anything across ranks (the caller all-reduces `expert_load` first
if it wants the global picture), or plot. Call these on the unwrapped eager model; under FSDP
every rank must run `attnres_depth_weights` (the forward gathers weights), only rank 0 logs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

import model.decoder as decoder_module
from model.attnres import mix_weights
from model.decoder import K3Model

Recorded = list[tuple[str, np.ndarray]]


def _numpy(t: torch.Tensor) -> np.ndarray:
    if hasattr(t, "full_tensor"):  # DTensor (e.g. a replicated buffer under a mesh)
        t = t.full_tensor()
    return t.detach().cpu().numpy()


def moe_layer_indices(model: K3Model) -> list[int]:
    """0-based decoder layer index of each MoE layer, in order (the rows of the matrices; the
    MTP layer's index is num_hidden_layers)."""
    return [layer.layer_idx for layer in _moe_decoder_layers(model)]


def _moe_decoder_layers(model: K3Model) -> list:
    return [layer for layer in model.decoder_layers() if hasattr(layer, "block_sparse_moe")]


def expert_load_matrix(model: K3Model, reset: bool = False) -> np.ndarray:
    """int64 [n_moe_layers, n_experts] tokens routed to each expert since the last reset.

    The routers only count in training forwards and never clear `expert_load` themselves; pass
    `reset=True` to zero it after reading, so each plot shows one logging interval.
    """
    rows = []
    for layer in _moe_decoder_layers(model):
        load = layer.block_sparse_moe.gate.expert_load
        rows.append(_numpy(load).astype(np.int64))
        if reset:
            load.zero_()
    return np.stack(rows) if rows else np.zeros((0, model.config.num_experts), np.int64)


def router_bias_matrix(model: K3Model) -> np.ndarray:
    """float32 [n_moe_layers, n_experts] Quantile-Balancing router biases."""
    gates = [layer.block_sparse_moe.gate for layer in _moe_decoder_layers(model)]
    rows = [_numpy(g.e_score_correction_bias).astype(np.float32) for g in gates]
    return np.stack(rows) if rows else np.zeros((0, model.config.num_experts), np.float32)


def attnres_source_labels(max_sources: int) -> list[str]:
    """Column names of the depth-weight matrix: emb, block1, ..., current."""
    if max_sources < 2:
        return ["current"][:max_sources]
    return ["emb", *(f"block{j}" for j in range(1, max_sources - 1)), "current"]


def _mix_labels(model: K3Model) -> dict[int, str]:
    """id(res_norm module) -> row label, for every mix site of the model."""
    labels = {}
    for i, layer in model.layers.items():
        labels[id(layer.self_attention_res_norm)] = f"L{i}.attn"
        labels[id(layer.mlp_res_norm)] = f"L{i}.mlp"
    labels[id(model.output_attn_res_norm)] = "final"
    return labels


@contextlib.contextmanager
def record_mixes(model: K3Model) -> Iterator[Recorded]:
    """While active, every AttnRes mix of `model` appends (label, mean weights [n_sources]).

    Swaps `model.decoder.mix` (the name the decoder calls) for a recording wrapper and always
    restores it; mixes of other models pass through unrecorded.
    """
    labels = _mix_labels(model)
    recorded: Recorded = []
    original = decoder_module.mix

    def recording_mix(prefix: torch.Tensor, blocks: torch.Tensor, norm: nn.Module,
                      proj: nn.Linear, eps: float) -> torch.Tensor:
        label = labels.get(id(norm))
        if label is not None:
            w = mix_weights(prefix, blocks, norm, proj, eps)  # [n_sources, B, T]
            recorded.append((label, _numpy(w.flatten(1).mean(1).double())))  # [n_sources]
        return original(prefix, blocks, norm, proj, eps)

    decoder_module.mix = recording_mix
    try:
        yield recorded
    finally:
        decoder_module.mix = original


def mixes_as_matrix(recorded: Recorded) -> tuple[np.ndarray, list[str]]:
    """Aligned layout: source j < n-1 in column j (emb, block1, ...), `current` in the last."""
    max_sources = max((len(w) for _, w in recorded), default=0)
    out = np.full((len(recorded), max_sources), np.nan)
    for r, (_, w) in enumerate(recorded):
        out[r, : len(w) - 1] = w[:-1]
        out[r, -1] = w[-1]
    return out, [label for label, _ in recorded]


@torch.no_grad()
def attnres_depth_weights(model: K3Model, input_ids: torch.Tensor,
                          cu_seqlens: torch.Tensor | None = None
                          ) -> tuple[np.ndarray, list[str]]:
    """(weights [n_mixes, max_sources] float64, row labels) from one forward on `input_ids`.

    Keep the batch small (e.g. 2 x 256 tokens): the forward materialises the logits.

    Rows in forward order: each layer's attention-side mix (when it has snapshots: every layer
    but the first), its MLP-side mix, then "final". Column j holds the mean weight of source j
    (emb, block1, ...); the running prefix ("current") is always the last column; columns a mix
    does not have are NaN. The model runs in eval mode (routers record no statistics) and every
    module's train/eval flag is restored afterwards.
    """
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with record_mixes(model) as recorded:
            model(input_ids, cu_seqlens)  # forward(), so FSDP's hooks gather the root's weights
    finally:
        for m, training in modes.items():
            m.training = training
    return mixes_as_matrix(recorded)

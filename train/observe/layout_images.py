"""The diagnostic images' arrays for any layout: whole-model matrices from a TP/PP-sharded model.

`train.observe.model_stats` reads one rank's model. Under pipeline parallelism a rank holds only its
stages' layers, and under tensor (sequence) parallelism each rank mixes only its slice of the
tokens, so here:
- router matrices (expert load, router bias): every pipeline rank's MoE rows, gathered and
  ordered by decoder layer (they are already equal over dp x tp after `balance_routers`);
- AttnRes depth weights: one no-grad pass of a single row through the stages in order, the
  (prefix, blocks) state handed from stage to stage with point-to-point sends (the same tensors
  the schedule sends), each stage recording its own mixes; the per-mix means are then averaged
  over the tp ranks (equal token counts each) and gathered over the pipeline.
Every rank of the job must call `layout_image_arrays` together; only the main rank plots.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from model.packing import Packing
from parallel.fsdp import unsharded_root
from parallel.parallel_model import ParallelModel
from parallel.pipeline_forward import forward_through_stages
from train.observe.model_stats import (
    attnres_depth_weights,
    expert_load_matrix,
    mixes_as_matrix,
    moe_layer_indices,
    record_mixes,
    router_bias_matrix,
)


def _gather_pp(obj, pp_group) -> list:
    parts: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, obj, group=pp_group)
    return parts


def router_matrices(pm: ParallelModel) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(expert load [L, E], router bias [L, E], decoder layer ids) of the whole model."""
    model = pm.model
    rows = list(zip(moe_layer_indices(model), expert_load_matrix(model),
                    router_bias_matrix(model)))
    if pm.meshes.pp is not None:
        rows = sorted((r for part in _gather_pp(rows, pm.meshes.pp.get_group()) for r in part),
                      key=lambda r: r[0])
    E = model.config.num_experts
    load = np.stack([r[1] for r in rows]) if rows else np.zeros((0, E), np.int64)
    bias = np.stack([r[2] for r in rows]) if rows else np.zeros((0, E), np.float32)
    return load, bias, [r[0] for r in rows]


def _pipeline_mixes(pm: ParallelModel, ids: torch.Tensor, cu: torch.Tensor,
                    dtype: torch.dtype) -> list:
    """(stage, recorded mixes) of this rank's stages for one row sent through the pipeline."""
    packing = Packing.from_host(cu.cpu(), *ids.shape, ids.device)
    stage_kw = {"cu_seqlens": packing.cu_seqlens.view(1, -1), "seq_len": ids.shape[1],
                "max_seqlen": packing.max_seqlen}
    passes = forward_through_stages(pm, ids, stage_kw, ids, dtype, around=record_mixes)
    return [(s, recorded) for s, _, recorded in passes]  # the last stage's loss is unused


def attnres_weights(pm: ParallelModel, ids: torch.Tensor, cu: torch.Tensor,
                    dtype: torch.dtype) -> tuple[np.ndarray, list[str]]:
    """Depth weights [n_mixes, max_sources] and row labels of one row `ids` [1, T] with
    document boundaries `cu`, for any layout (see the module docstring)."""
    if pm.meshes.pp is None:
        with unsharded_root(pm.model):
            weights, labels = attnres_depth_weights(pm.model, ids, cu)
    else:
        modes = {m: m.training for m in pm.model.modules()}
        pm.model.eval()  # routers record no statistics
        try:
            stages = _pipeline_mixes(pm, ids, cu, dtype)
        finally:
            for m, training in modes.items():
                m.training = training
        parts = _gather_pp(stages, pm.meshes.pp.get_group())
        recorded = [mix for _, rec in sorted(p for part in parts for p in part) for mix in rec]
        weights, labels = mixes_as_matrix(recorded)
    if pm.meshes.tp is not None:  # each tp rank mixed T/tp tokens: average the means
        t = torch.from_numpy(weights).to(ids.device)
        dist.all_reduce(t, group=pm.meshes.tp.get_group())
        weights = t.cpu().numpy() / pm.meshes.tp.size()
    return weights, labels

"""A no-grad forward through the pipeline stages in order, outside the training schedule.

Validation and the diagnostic images need a forward pass of a pipeline-parallel model without a
backward. The torch schedules' `eval` varies across the torch versions we support, and a
forward-only pass needs no overlap, so this walks the stages in order: each rank runs the stages
it holds, receiving the stage state (AttnRes prefix and blocks, MTP's next-token embeddings:
`stage_io_meta`) from the previous stage's rank and sending its own to the next with
point-to-point ops on the pipeline group, the tensors the schedule sends. Every rank of the
pipeline group must call it together. The last stage returns its loss sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel.pipeline import stage_indices, stage_io_meta


@torch.no_grad()
def forward_through_stages(pm, ids: torch.Tensor, stage_kw: dict, labels: torch.Tensor,
                           dtype: torch.dtype, around: Callable | None = None) -> list:
    """[(stage, result, what `around(model)` yielded)] for this rank's stages, in order.

    `ids` [B, T]: whole rows of token ids (what the first stage takes); `stage_kw`: cu_seqlens
    [1, W], seq_len, max_seqlen; `labels`: this rank's (context-parallel) window of targets;
    `around`: an optional context-manager factory entered around each stage's forward."""
    dims, model = pm.dims, pm.model
    pp_group = pm.meshes.pp.get_group()
    owner = {s: r for r in range(dims.pp)
             for s in stage_indices(r, dims.pp, dims.num_stages, dims.pp_schedule)}
    me = pm.meshes.pp_rank
    mine = dict(zip(pm.stages, pm.stage_modules))
    state: tuple[torch.Tensor, ...] = ()
    out = []
    for s in range(dims.num_stages):
        if owner[s] != me:
            continue
        if s > 0 and owner[s - 1] != me:  # receive the state the previous stage sent
            meta = stage_io_meta(model.config, pm.splits, s, ids.shape[0], ids.shape[1],
                                 dims.tp, dtype, dims.cp)[0]
            state = tuple(torch.empty(m.shape, dtype=m.dtype, device=ids.device) for m in meta)
            src = dist.get_global_rank(pp_group, owner[s - 1])
            for t in state:
                dist.recv(t, src=src, group=pp_group)
        inputs = (ids,) if s == 0 else state
        with around(model) if around else contextlib.nullcontext() as extra:
            result = mine[s](*inputs, **stage_kw, labels=labels)
        out.append((s, result, extra))
        if s < dims.num_stages - 1:
            state = tuple(t.contiguous() for t in result)
            if owner[s + 1] != me:
                dst = dist.get_global_rank(pp_group, owner[s + 1])
                for t in state:
                    dist.send(t, dst=dst, group=pp_group)
    return out

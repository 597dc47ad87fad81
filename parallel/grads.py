"""The global gradient norm and clipping for any layout (FSDP, TP, PP, EP meshes mixed).

`torch.nn.utils.clip_grad_norm_` fails when parameters sit on different meshes (cpu-testing.md
trap 5: FSDP x TP, experts on the EP mesh, plain tensors). Here each rank sums the squares of
its local gradient pieces, each divided by the number of ranks that hold an identical copy of
that piece, and one all-reduce over the world gives the exact squared norm: a piece is copied
once per rank of the mesh dims it is replicated on and of the non-pipeline ranks outside its
mesh; pipeline ranks hold different layers.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _copies(g: torch.Tensor, ranks_per_stage: int) -> int:
    if not isinstance(g, DTensor):
        return ranks_per_stage
    # any non-replicated placement splits the tensor (Shard, and FSDP's _StridedShard over TP,
    # which is not a Shard subclass)
    sharded = math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements)
                        if not p.is_replicate())
    return ranks_per_stage // sharded


@torch.no_grad()
def takes_grad_scale(optimizer) -> bool:
    """Whether `optimizer.step()` divides the gradients by `optimizer.grad_scale` itself:
    torch's fused Adam/AdamW (the `grad_scale` attribute GradScaler also sets)."""
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            and bool(optimizer.defaults.get("fused")))


def clip_grad_norm(params, max_norm: float, pp: int = 1, optimizer=None,
                   flags: torch.Tensor | None = None) -> float:
    """Clip to `max_norm` (inf: measure only); returns the norm before clipping.

    `flags` [rows, world] (float64, zeros but what the caller set in this rank's column):
    this rank sets its last row's entry to 1 if its own gradients are not finite, and the same
    all-reduce as the norm sums the flags, so every rank learns which ranks produced a
    non-finite step at no extra cost.

    The gradients are scaled in place, except for an `optimizer` that `takes_grad_scale`: it
    gets grad_scale = 1 / clip factor (a device tensor) and applies it inside its own pass over
    the gradients, which saves one read and write of every gradient per step.

    Norms come from `torch._foreach_norm` over the local pieces grouped by copy count and
    dtype, accumulated in float64 (`dtype=`, no stored float64 copy of any gradient): with fp32
    accumulation the norm, and so the clip factor, would depend on how the gradients are
    sharded, and layouts would drift apart from one rank (MXFP8 amplifies it: 2e-5 in the loss
    by step 7). The clip factor stays a tensor; the returned float is the one norm readout."""
    grads = [p.grad for p in params if p.grad is not None]
    ranks_per_stage = (dist.get_world_size() if dist.is_initialized() else 1) // pp
    device = grads[0].device if grads else torch.device("cpu")
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g, local in zip(grads, locals_):
        if local.numel():
            groups[(_copies(g, ranks_per_stage), local.dtype, local.device)].append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (copies, _, _), pieces in groups.items():
        norms = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64))
        total += norms.pow(2).sum().to(device) / copies
    if flags is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        flags[-1, rank] = (~torch.isfinite(total)).to(flags.dtype).to(flags.device)
        total = torch.cat([total.view(1), flags.flatten().to(total.device)])
    if dist.is_initialized():
        dist.all_reduce(total)
    if flags is not None:
        flags.copy_(total[1:].view_as(flags))
        total = total[0]
    norm = total.sqrt()
    fold = optimizer is not None and takes_grad_scale(optimizer)
    if fold:
        optimizer.grad_scale = None
    if math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if fold:
            optimizer.grad_scale = (1.0 / coef).to(torch.float32)
        else:
            for (_, dtype, dev), pieces in groups.items():
                torch._foreach_mul_(pieces, coef.to(dev, dtype))
    return float(norm)

"""Tensor parallelism with sequence parallelism for the hybrid K3 model (Megatron-style regions).

Between TP regions every rank holds a slice of the sequence (`[B, T/tp, d]`): norms, AttnRes
mixes, the router and the latent MoE run on those tokens only (the loss gathers them for the
vocabulary-parallel head). A TP region (KDA, Gated
MLA, the dense MLP, the shared experts) all-gathers its input along the sequence, runs on this
rank's heads or MLP columns, and reduce-scatters its output back to sequence slices; in backward
the two collectives swap. One all-gather and one reduce-scatter per region, whatever the number
of projections inside.

Parameters are DTensors on the tp mesh: the plan below shards heads (and their per-head gate
parameters and short convs) by output rows, output projections by input columns, the LM head
(`parallel.loss_parallel`) and the embedding by vocabulary rows; everything else is
replicated. Model code
computes on plain tensors: while a layer (or the root) runs, each of its parameters is shadowed
by its local shard (`DTensor.to_local`). The gradient of a
replicated parameter is then this rank's partial sum (its tokens, or its heads), and
`allreduce_replicated_grads` sums it over tp after backward, like Megatron's sequence-parallel
gradient all-reduce. DTensor parameters keep DCP checkpoints layout-free and FSDP 2-D.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from model.decoder import K3Model
from model.kda import KimiDeltaAttention
from model.mla import GatedMLA
from model.mlp import SiTUMLP
from parallel.collectives import all_gather, reduce_scatter
from parallel.loss_parallel import vocab_parallel_cross_entropy

# module class -> {parameter path inside it: the dim sharded over tp}; the rest is replicated
TP_PLAN: dict[type, dict[str, int]] = {
    KimiDeltaAttention: {
        "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0,
        "q_conv1d.weight": 0, "k_conv1d.weight": 0, "v_conv1d.weight": 0,
        "f_b_proj.weight": 0, "A_log": 0, "dt_bias": 0, "b_proj.weight": 0,
        "g_proj.weight": 0, "o_proj.weight": 1},  # f_a_proj (low rank) and o_norm: replicated
    GatedMLA: {
        "q_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0, "g_proj.weight": 0,
        "o_proj.weight": 1},  # q_a/kv_a down-projections and their norms: replicated
    SiTUMLP: {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1},
    K3Model: {"lm_head.weight": 0, "embed_tokens.weight": 0},  # vocabulary-parallel ends
}


def tp_shard_plan(model: nn.Module) -> dict[str, int]:
    """Full parameter name -> sharded dim, for every parameter the plan shards."""
    names = {n for n, _ in model.named_parameters()}
    plan = {}
    for mod_name, module in model.named_modules():
        for pname, dim in TP_PLAN.get(type(module), {}).items():
            full = f"{mod_name}.{pname}" if mod_name else pname
            if full in names:
                plan[full] = dim
    return plan


def apply_tensor_parallel(model: K3Model, tp_mesh) -> None:
    """Shard `model` (on the meta device) over `tp_mesh` (1-D) and install the SP regions.

    Parameters that already are DTensors (expert-parallel experts) are left as they are."""
    tp = tp_mesh.size()
    group = tp_mesh.get_group()
    plan = tp_shard_plan(model)
    for mod_name, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            placement = Shard(plan[full]) if full in plan else Replicate()
            dt = distribute_tensor(p.data, tp_mesh, [placement], src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))
    for module in model.modules():
        if isinstance(module, (KimiDeltaAttention, GatedMLA)):
            module.num_heads //= tp
        if isinstance(module, (KimiDeltaAttention, GatedMLA, SiTUMLP)):
            _make_region(module, group)
    rank = tp_mesh.get_local_rank()
    if model.lm_head is not None:
        model.cross_entropy = functools.partial(
            vocab_parallel_cross_entropy, group=group,
            vocab_start=rank * (model.config.vocab_size // tp))
    if model.embed_tokens is not None:
        _vocab_parallel_embedding(model.embed_tokens, group, tp, rank)
    for layer in model.decoder_layers():  # the MTP layer too: its own FSDP unit
        _scope_locals(layer, "forward", [layer])
    roots = [m for n, m in model.named_children() if n != "layers"]
    for method in ("forward", "forward_stage"):
        _scope_locals(model, method, roots, labels_slice=(tp, rank))


def _vocab_parallel_embedding(module: nn.Embedding, group, tp: int, rank: int) -> None:
    """Embedding rows split by vocabulary: each rank looks up the tokens whose rows it holds
    (zeros for the others), and one reduce-scatter sums the partial lookups and leaves each rank
    its sequence slice (Megatron's vocabulary-parallel embedding fused with the SP scatter).
    Exactly one rank contributes each token, so the sum is exact in any dtype; in backward the
    all-gathered gradient reaches each token's owner only, so no tp all-reduce is needed."""
    rows = module.num_embeddings // tp
    start = rank * rows

    def forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - start
        inside = (local >= 0) & (local < rows)  # [B, T]
        out = nn.functional.embedding(torch.where(inside, local, 0), module.weight)  # [B, T, d]
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return reduce_scatter(out.contiguous(), "sum", 1, group)  # [B, T/tp, d]

    module.forward = forward


def _make_region(module: nn.Module, group) -> None:
    """Sequence-slice input -> full sequence in, partial sums -> reduce-scattered slices out."""

    def gather(mod, args):
        x, *rest = args
        dim = 1 if x.ndim == 3 else 0  # [B, T/tp, d] or flattened tokens [S/tp, d]
        return (all_gather(x.contiguous(), dim, group), *rest)

    def scatter(mod, args, out):
        dim = 1 if out.ndim == 3 else 0
        return reduce_scatter(out.contiguous(), "sum", dim, group)

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(scatter)


def _scope_locals(owner: nn.Module, method: str, roots: list[nn.Module],
                  labels_slice: tuple[int, int] | None = None) -> None:
    """Wrap `owner.<method>` so that, while it runs, every DTensor parameter under `roots` reads
    as its local shard. The instance attribute shadows the registered parameter; the parameter
    is looked up at call time, so FSDP's unsharded parameters (swapped in by its pre-forward
    hook, which runs before this wrapper) are the ones used. On the root, `labels` are cut to
    this rank's sequence slice so that they pair with the sequence-parallel hidden states; the
    vocabulary-parallel loss gathers both in the same (rank-major) token order."""
    inner: Callable = getattr(owner, method)
    slots = [(m, n) for r in roots for m in r.modules() for n, _ in m.named_parameters(
        recurse=False)]

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        if labels_slice is not None and kwargs.get("labels") is not None:
            tp, rank = labels_slice
            kwargs["labels"] = kwargs["labels"].chunk(tp, dim=1)[rank]
        if labels_slice is not None and len(args) >= 3 and args[2] is not None:
            tp, rank = labels_slice  # forward(input_ids, cu_seqlens, labels)
            args = (*args[:2], args[2].chunk(tp, dim=1)[rank], *args[3:])
        installed = []
        for m, n in slots:
            p = m._parameters.get(n)
            # only parameters gathered to the tp mesh: expert-parallel experts live on the expert
            # mesh and are localised by their dispatcher (inside their own FSDP unit)
            # (a wrapper nested in another, the MTP layer's in the root's, leaves it installed)
            if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tp",) \
                    and n not in m.__dict__:
                object.__setattr__(m, n, p.to_local())
                installed.append((m, n))
        try:
            return inner(*args, **kwargs)
        finally:
            for m, n in installed:
                del m.__dict__[n]

    setattr(owner, method, wrapped)


def tp_replicated_params(params, tp_mesh) -> list[nn.Parameter]:
    """Parameters replicated over the tp mesh dim (their gradients are partial sums)."""
    name = tp_mesh.mesh_dim_names[0]
    out = []
    for p in params:
        if isinstance(p, DTensor) and name in (p.device_mesh.mesh_dim_names or ()):
            dim = p.device_mesh.mesh_dim_names.index(name)
            if isinstance(p.placements[dim], Replicate):
                out.append(p)
    return out


@torch.no_grad()
def allreduce_replicated_grads(params: list[nn.Parameter], group) -> None:
    """Sum the partial gradients of tp-replicated parameters over tp (one flat all-reduce)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in gs:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

"""Expert parallelism for the K3 model with the MoonEP dispatcher (dynamic expert replicas).

Each MoE layer's routed-expert stacks w1/w3/w2 [E, ...] become DTensors sharded by expert
(Shard(0)) over the EP mesh, so every rank holds E/ep home experts and checkpoints stay
layout-free (DCP reshards them into any other layout). The layer's dispatcher becomes a
`moonep.MoonEPDispatcher`: tokens go to the ranks owning (or replicating) their experts and the
grouped GEMM runs over [home experts | replicas]. The EP ranks are taken from dp_shard x tp
(`parallel.dims`). When ep = dp_shard x tp the layers' FSDP leaves the expert stacks alone
(`ignored_params`); when it is smaller each MoE layer's `experts` module is its own FSDP unit
over the edp ranks that hold the same experts (`parallel.parallelize`).
Replicas are fetched from the gathered home weights inside that unit's forward, so their
gradients are summed home before FSDP reduce-scatters. `finalize_expert_grads` removes the
data-parallel loss factor FSDP did not (see there).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from model.moe import in_recomputation
from moonep import MoonEPDispatcher, max_over_mean, static_load

EXPERT_PARAMS = ("w1", "w3", "w2")


class ExpertParallelDispatcher:
    """The model's dispatcher contract on top of `MoonEPDispatcher` (DTensor experts -> local)."""

    def __init__(self, group, num_experts: int, replicas: bool, pad_multiple: int = 1) -> None:
        self.inner = MoonEPDispatcher(group, num_experts, replicas=replicas,
                                      pad_multiple=pad_multiple)
        self.reset_load_stats()

    def reset_load_stats(self) -> None:
        # sums over dispatches of max/mean EP-rank load without and with replicas, and the count
        self.load_stats = [0.0, 0.0, 0]

    def dispatch(self, x, topk_idx, topk_weight):
        x_grouped, sizes, handle = self.inner.dispatch(x, topk_idx, topk_weight)
        if in_recomputation():  # activation-checkpoint recompute: already counted
            return x_grouped, sizes, handle
        plan = handle.plan
        self.load_stats[0] += max_over_mean(static_load(plan.alloc.sum(1), plan.num_ranks))
        self.load_stats[1] += max_over_mean(plan.rank_load)
        self.load_stats[2] += 1
        return x_grouped, sizes, handle

    def combine(self, y, handle):
        return self.inner.combine(y, handle)

    def expert_weights(self, handle, experts: nn.Module) -> tuple[torch.Tensor, ...]:
        local = [getattr(experts, n) for n in EXPERT_PARAMS]
        local = [p.to_local() if isinstance(p, DTensor) else p for p in local]  # [E/ep, ...]
        return self.inner.gather_expert_weights(handle, *local)


def apply_expert_parallel(model: nn.Module, mesh, replicas: bool = True) -> set[nn.Parameter]:
    """Shard routed experts over `mesh` (1-D, the EP ranks, which may include tp ranks: each
    routes its own sequence slice); returns the expert parameters."""
    params: set[nn.Parameter] = set()
    for moe in model.moe_layers():  # type: ignore[union-attr]
        experts = moe.experts
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            sharded = nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)],
                                                     src_data_rank=None))
            setattr(experts, name, sharded)
            params.add(sharded)
        moe.dispatcher = ExpertParallelDispatcher(mesh.get_group(), experts.w1.shape[0],
                                                  replicas)
    return params


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The routed-expert stacks of every MoE layer (looked up by name, after materialising)."""
    return {getattr(moe.experts, n) for moe in model.moe_layers()  # type: ignore[union-attr]
            for n in EXPERT_PARAMS}


def ep_load_metrics(model: nn.Module) -> dict[str, list[float] | float]:
    """Per-MoE-layer EP-rank load max/mean since the last call (before and after replicas),
    averaged over the step's dispatches, plus their means over layers; resets the counters."""
    static, replicated = [], []
    for moe in model.moe_layers():  # type: ignore[union-attr]
        d = moe.dispatcher
        if isinstance(d, ExpertParallelDispatcher) and d.load_stats[2]:
            static.append(d.load_stats[0] / d.load_stats[2])
            replicated.append(d.load_stats[1] / d.load_stats[2])
            d.reset_load_stats()
    if not static:
        return {}
    return {"ep_rank_load_static": static, "ep_rank_load_replicated": replicated,
            "ep_rank_load_static_mean": sum(static) / len(static),
            "ep_rank_load_replicated_mean": sum(replicated) / len(replicated)}


def finalize_expert_grads(expert_params: set[nn.Parameter], divisor: float) -> None:
    """Undo the rest of the data-parallel loss factor on the expert gradients.

    The loss is pre-multiplied by dp (FSDP averages dense gradients over dp). A home expert sums
    the gradients of every token its ep group routed to it (each token once: under sequence
    parallelism a tp rank holds its own tokens), and FSDP over the edp ranks averages those:
    `divisor` = dp / edp (`ParallelDims.expert_grad_divisor`) is left over."""
    for p in expert_params:
        if p.grad is not None:
            p.grad.div_(divisor)

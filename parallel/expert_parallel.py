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

from collections import deque

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from model.moe import in_recomputation
from moonep import MoonEPDispatcher, static_load

EXPERT_PARAMS = ("w1", "w3", "w2")


def _max_over_mean(load: torch.Tensor) -> torch.Tensor:
    """0-dim float64 max(load) / mean(load) on load's device (1 for an all-zero load)."""
    load = load.double()
    mean = load.mean()
    return torch.where(mean == 0, torch.ones_like(mean), load.max() / mean.clamp(min=1e-30))


class ExpertParallelDispatcher:
    """The model's dispatcher contract on top of `MoonEPDispatcher` (DTensor experts -> local).

    With activation checkpointing (`reuse_plans`), every training forward's route is kept and the
    recompute in backward takes them back in order (first in, first out: backward visits a
    layer's micro-batches in forward order under gradient accumulation and every pipeline
    schedule), so the recompute neither plans, nor exchanges counts, nor reads the host again.
    Load statistics stay on the device until `ep_load_metrics` reads them once per step."""

    def __init__(self, group, num_experts: int, replicas: bool, pad_multiple: int = 1,
                 reuse_plans: bool = False) -> None:
        self.inner = MoonEPDispatcher(group, num_experts, replicas=replicas,
                                      pad_multiple=pad_multiple)
        self.reuse_plans = reuse_plans
        self.saved_routes: deque = deque()
        self.reset_load_stats()

    def reset_load_stats(self) -> None:
        # device sums over dispatches of max/mean EP-rank load without and with replicas
        self.load_sum: torch.Tensor | None = None
        self.load_count = 0
        self.saved_routes.clear()  # a forward without backward must not shift the next step

    def dispatch(self, x, topk_idx, topk_weight, during=None):
        if in_recomputation():  # activation-checkpoint recompute: reuse the forward's route
            route = self.saved_routes.popleft() if self.saved_routes else None
            return self.inner.dispatch(x, topk_idx, topk_weight, route, during)
        route = self.inner.route(topk_idx)
        if self.reuse_plans and torch.is_grad_enabled():
            self.saved_routes.append(route)
        plan = route.plan
        static = static_load(plan.alloc.sum(1), plan.num_ranks)
        loads = torch.stack([_max_over_mean(static), _max_over_mean(plan.rank_load)])
        self.load_sum = loads if self.load_sum is None else self.load_sum + loads
        self.load_count += 1
        return self.inner.dispatch(x, topk_idx, topk_weight, route, during)

    def combine(self, y, handle):
        return self.inner.combine(y, handle)

    def expert_weights(self, handle, experts: nn.Module) -> tuple[torch.Tensor, ...]:
        local = [getattr(experts, n) for n in EXPERT_PARAMS]
        local = [p.to_local() if isinstance(p, DTensor) else p for p in local]  # [E/ep, ...]
        return self.inner.gather_expert_weights(handle, *local)


def apply_expert_parallel(model: nn.Module, mesh, replicas: bool = True,
                          reuse_plans: bool = False) -> set[nn.Parameter]:
    """Shard routed experts over `mesh` (1-D, the EP ranks, which may include tp ranks: each
    routes its own sequence slice); returns the expert parameters. `reuse_plans`: the layers are
    activation-checkpointed, so recomputes reuse the forward's routes."""
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
                                                  replicas, reuse_plans=reuse_plans)
    return params


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The routed-expert stacks of every MoE layer (looked up by name, after materialising)."""
    return {getattr(moe.experts, n) for moe in model.moe_layers()  # type: ignore[union-attr]
            for n in EXPERT_PARAMS}


def ep_load_metrics(model: nn.Module) -> dict[str, list[float] | float]:
    """Per-MoE-layer EP-rank load max/mean since the last call (before and after replicas),
    averaged over the step's dispatches, plus their means over layers; resets the counters."""
    dispatchers = [moe.dispatcher for moe in model.moe_layers()]  # type: ignore[union-attr]
    dispatchers = [d for d in dispatchers if isinstance(d, ExpertParallelDispatcher)]
    used = [d for d in dispatchers if d.load_count]
    if not used:
        for d in dispatchers:
            d.reset_load_stats()
        return {}
    means = torch.stack([d.load_sum / d.load_count for d in used]).tolist()  # one host read
    for d in dispatchers:
        d.reset_load_stats()
    static = [m[0] for m in means]
    replicated = [m[1] for m in means]
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

"""moonep: MoonEP-style expert parallelism with dynamic expert replicas.

What: a per-step planner that, from all ranks' per-expert token counts, replicates hot experts onto
other EP ranks so that every rank processes exactly its share of the (token, expert) pairs, with at
most E/R replica slots per rank (`plan_replicas`), and the deterministic, contiguous mapping of
pairs to (rank, GEMM group, row) (`assign_tokens`). `python -m moonep.simulate` runs the planner on
synthetic skewed routing and reports balance and traffic.

`MoonEPDispatcher` (moonep/dispatch.py) is the expert-parallel dispatcher with the same
dispatch/combine contract as `model.dispatch.LocalDispatcher`, and `gather_expert_weights` fetches
replica weights differentiably (moonep/replicas.py): replica gradients are added into the home
experts' gradients.

Deliberately not: dedup of tokens per destination rank, communication/compute overlap, FSDP
wiring. This package never imports `model/` or `train/`.
"""

from moonep.dispatch import MoonEPDispatcher, MoonEPHandle, static_plan
from moonep.planner import (
    Assignment,
    ReplicaPlan,
    assign_tokens,
    max_over_mean,
    pair_traffic,
    plan_replicas,
    rank_targets,
    static_load,
)

__all__ = [
    "Assignment",
    "MoonEPDispatcher",
    "MoonEPHandle",
    "ReplicaPlan",
    "assign_tokens",
    "max_over_mean",
    "pair_traffic",
    "plan_replicas",
    "rank_targets",
    "static_load",
    "static_plan",
]

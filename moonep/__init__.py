"""moonep: MoonEP-style expert parallelism with dynamic expert replicas.

What: a per-step planner that, from all ranks' per-expert token counts, replicates hot experts onto
other EP ranks so that every rank processes exactly its share of the (token, expert) pairs, with at
most E/R replica slots per rank (`plan_replicas` on the host, the oracle; `plan_replicas_device`,
bit-equal and free of host reads, which training uses), and the deterministic, contiguous mapping
of pairs to (rank, GEMM group, row) (`assign_tokens`, validated; `assign_pairs`, on any device).
`python -m moonep.simulate` runs the planners on synthetic skewed routing and reports balance,
traffic and planning time.

`MoonEPDispatcher` (moonep/dispatch.py) is the expert-parallel dispatcher with the same
dispatch/combine contract as `model.dispatch.LocalDispatcher` (one host read per call), and
`gather_expert_weights` fetches replica weights differentiably in one all-to-all
(moonep/replicas.py): replica gradients are added into the home experts' gradients.

Deliberately not: dedup of tokens per destination rank, FSDP wiring. This package never imports
`model/` or `train/`.
"""

from moonep.device_planner import plan_replicas_device
from moonep.dispatch import MoonEPDispatcher, MoonEPHandle, MoonEPRoute, static_plan
from moonep.planner import (
    Assignment,
    ReplicaPlan,
    assign_pairs,
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
    "MoonEPRoute",
    "ReplicaPlan",
    "assign_pairs",
    "assign_tokens",
    "max_over_mean",
    "pair_traffic",
    "plan_replicas",
    "plan_replicas_device",
    "rank_targets",
    "static_load",
    "static_plan",
]

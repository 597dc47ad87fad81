"""Stage h (moonep): the MoonEP device planner on the GPU against the host planner (the oracle).

    python benchmarks/gpu/h_moonep.py [--device cuda] [--small]

Counts [R, E] per case: Zipf-skewed random (skew 0 to 1.5), one hot expert, one hot home group,
all zero, all equal; at K3 shape E 896, R 64 (about 4096 tokens x top-16 per rank) plus E 8 with
R 2, 4, 8. Every backend that runs on the device ("triton" on CUDA, the single-program kernel;
"torch", the fixed-iteration tensor loop) must equal `moonep.planner.plan_replicas` bit for bit
(alloc, replica_slots, rank_load, and `ok`). Reports mismatches per backend, the median ms per
call at K3 shape (synchronised, after a warm-up), and the ops each call dispatches.
`--small` (CPU smoke run): the torch backend only, fewer cases.
"""

from __future__ import annotations

import time

import gpu_common as common
import torch

from moonep.device_planner import plan_replicas_device, planner_launches
from moonep.planner import plan_replicas


def _cases(n_random: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for E, R in [(896, 64)] * 3 + [(8, 2), (8, 4), (8, 8)]:
        for i in range(n_random):
            skew = 1.5 * i / max(1, n_random - 1)
            weight = (torch.randperm(E, generator=g) + 1.0) ** -skew
            mean = 4096 * 16 / E if E == 896 else 6.0
            lam = (weight / weight.mean() * mean).expand(R, E)
            out.append((torch.poisson(lam, generator=g).long(), R))
        hot = torch.zeros(R, E, dtype=torch.long)
        hot[:, 0] = 50
        group = torch.zeros(R, E, dtype=torch.long)
        group[:, : E // R] = 7
        out += [(hot, R), (group, R), (torch.zeros(R, E, dtype=torch.long), R),
                (torch.full((R, E), 3, dtype=torch.long), R)]
    return out


def _equal(ref, got, ok) -> bool:
    return bool(ok) and all(torch.equal(getattr(ref, k), getattr(got, k).cpu())
                            for k in ("alloc", "replica_slots", "rank_load"))


def main(ctx: common.Ctx, out: dict) -> bool:
    dev = ctx.device
    backends = ["torch"] + (["triton"] if ctx.cuda else [])
    cases = _cases(4 if ctx.small else 40)
    out.update(cases=len(cases), backends=backends)
    refs = [plan_replicas(c, R) for c, R in cases]
    k3 = next(c for c, R in cases if R == 64)
    t_host = []
    for _ in range(5):
        t0 = time.perf_counter()
        plan_replicas(k3, 64)
        t_host.append(time.perf_counter() - t0)
    out["plan_ms_host"] = 1e3 * sorted(t_host)[2]
    for b in backends:
        def check(b=b) -> dict:
            bad = sum(not _equal(ref, *plan_replicas_device(c.to(dev), R, backend=b))
                      for ref, (c, R) in zip(refs, cases))
            k3_dev = k3.to(dev)
            plan_replicas_device(k3_dev, 64, backend=b)  # warm-up (kernel compile)
            times = []
            for _ in range(20):
                ctx.sync()
                t0 = time.perf_counter()
                plan_replicas_device(k3_dev, 64, backend=b)
                ctx.sync()
                times.append(time.perf_counter() - t0)
            return {"mismatches": bad, "plan_ms_k3": 1e3 * sorted(times)[10],
                    "ops_k3": planner_launches(k3_dev, 64, backend=b)}
        if ctx.left() < 5:
            common.skip(out, b)
            continue
        common.attempt(out, b, check)
    results = [out.get(b) for b in backends]
    out["device_equals_host"] = all(isinstance(r, dict) and r["mismatches"] == 0
                                    for r in results)
    return True


if __name__ == "__main__":
    common.run_stage("moonep", main)

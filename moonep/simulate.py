"""Simulate MoonEP replica planning on synthetic skewed routing; print one JSON line.

    python -m moonep.simulate --experts 896 --topk 16 --ranks 64 --tokens-per-rank 4096 \
        --skew 1.0 --seed 0

What: expert popularity p_e ∝ 1 / (z_e + 1)^skew, where z is a seeded random permutation of the
experts (Zipf over shuffled experts; skew 0 = uniform). Each of ranks × tokens-per-rank tokens
picks topk *distinct* experts by sequential sampling without replacement from p (the Plackett-Luce
law, the same as Gumbel-top-k over log p), vectorised over tokens (numpy). Per-source counts feed
the real `plan_replicas` (timed: planner_ms), and the output reports balance and bytes for ONE
MoE layer's forward of one micro-batch, summed over all ranks:

* max_over_mean_static / _replicated: max rank load / mean, without / with replicas.
* max_replica_slots_used: most filled replica slots on a rank (bound: experts / ranks).
* replica_weight_bytes_per_step: filled slots × 3 × hidden × expert_intermediate × bytes
  (w1, w3, w2 of one expert copied from its home rank; forward only).
  replica_grad_bytes_per_step: the same count × grad bytes, sent back in backward (bf16 default;
  MoonEP reduces fp32 grads: --grad-bytes 4).
* token_bytes_per_step: 2 × (pairs whose destination rank != source rank) × hidden × bytes, i.e.
  latent activations moved by dispatch and by combine. Per pair, an upper bound: no dedup of a
  token sent to several experts on one rank. token_bytes_per_step_static: the same without replicas.
* plan_ms_host (= planner_ms, kept for compatibility): median time of the host `plan_replicas`.
  plan_ms_device: median time of `plan_replicas_device(..., backend="torch")` on this machine's
  CPU tensors (the sync-free planner; on a GPU the Triton backend replaces it).
  plan_ops_device: aten ops (views excluded) one such call dispatches, a fixed count for a given
  (E, R) whatever the counts. device_equals_host: its alloc, replica_slots and rank_load equal the
  host plan's bit for bit and its `ok` flag is True.

Deliberately not: communication, timing of GEMMs, or tokens per rank varying inside a step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from torch import Tensor

from moonep.device_planner import plan_replicas_device, planner_launches
from moonep.planner import max_over_mean, pair_traffic, plan_replicas, static_load


def zipf_popularity(num_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """[E] float64 probabilities ∝ 1 / (rank + 1)^skew over a seeded random expert permutation."""
    weight = (rng.permutation(num_experts) + 1.0) ** -skew
    return weight / weight.sum()


def _complement_draw(p: np.ndarray, cdf: np.ndarray, prev: np.ndarray,
                     rng: np.random.Generator) -> np.ndarray:
    """[m] one draw per column from p restricted to experts not in prev [j, m] (exact: a uniform
    point on the remaining mass skips the chosen experts' cdf intervals in ascending order)."""
    prev = np.sort(prev, axis=0)
    start = cdf - p
    x = rng.random(prev.shape[1]) * (cdf[-1] - p[prev].sum(0))
    for c in prev:
        x += p[c] * (x >= start[c])
    pick = np.minimum(np.searchsorted(cdf, x, side="right"), p.size - 1)
    bad = np.flatnonzero((prev == pick).any(0))
    while bad.size:  # float rounding at an interval edge (rare): redraw those by rejection
        pick[bad] = rng.choice(p.size, bad.size, p=p)
        bad = bad[(prev[:, bad] == pick[bad]).any(0)]
    return pick


def sample_without_replacement(p: np.ndarray, n: int, k: int, rng: np.random.Generator,
                               max_rounds: int = 32) -> np.ndarray:
    """[n, k] distinct expert ids per row: slot j is drawn from p conditioned on differing from
    slots < j (exact sequential sampling without replacement). Vectorised over rows: rejection
    rounds while at least half the rows accept (at most max_rounds), then an exact draw on the
    remaining mass for the rest, so heavy skew stays O(n k^2)."""
    if not 0 <= k <= p.size:
        raise ValueError(f"topk {k} not in [0, {p.size}]")
    cdf = np.cumsum(p)
    chosen = np.empty((k, n), dtype=np.int64)
    for j in range(k):
        rows = np.arange(n)
        for _ in range(max_rounds):
            u = rng.random(rows.size) * cdf[-1]
            cand = np.minimum(np.searchsorted(cdf, u, side="right"), p.size - 1)
            ok = ~(chosen[:j, rows] == cand).any(0)
            chosen[j, rows[ok]] = cand[ok]
            rows = rows[~ok]
            if 2 * rows.size > ok.size or not rows.size:
                break
        if rows.size:
            chosen[j, rows] = _complement_draw(p, cdf, chosen[:j, rows], rng)
    return chosen.T


def synthetic_counts(experts: int, topk: int, ranks: int, tokens_per_rank: int, skew: float,
                     seed: int) -> Tensor:
    """[ranks, experts] int64 pairs per (source rank, expert) for one synthetic step."""
    rng = np.random.default_rng(seed)
    p = zipf_popularity(experts, skew, rng)
    chosen = sample_without_replacement(p, ranks * tokens_per_rank, topk, rng)
    src = np.arange(ranks * tokens_per_rank) // tokens_per_rank
    flat = (src[:, None] * experts + chosen).ravel()
    counts = np.bincount(flat, minlength=ranks * experts).reshape(ranks, experts)
    return torch.from_numpy(counts.astype(np.int64))


def simulate(args: argparse.Namespace) -> dict:
    counts = synthetic_counts(args.experts, args.topk, args.ranks, args.tokens_per_rank,
                              args.skew, args.seed)
    capacity = args.tokens_per_rank * args.topk
    plan = plan_replicas(counts, args.ranks, capacity=capacity)  # warm-up, then time
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plan = plan_replicas(counts, args.ranks, capacity=capacity)
        times.append(time.perf_counter() - t0)
    device_plan, ok = plan_replicas_device(counts, args.ranks, backend="torch")  # warm-up
    device_times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        device_plan, ok = plan_replicas_device(counts, args.ranks, backend="torch")
        device_times.append(time.perf_counter() - t0)
    device_equal = bool(ok) and all(
        torch.equal(getattr(plan, k), getattr(device_plan, k))
        for k in ("alloc", "replica_slots", "rank_load"))
    traffic = pair_traffic(plan, counts)
    remote = int(traffic.sum() - traffic.diagonal().sum())
    epn = args.experts // args.ranks
    home = torch.arange(args.experts) // epn
    remote_static = int(counts[home.unsqueeze(0) != torch.arange(args.ranks).unsqueeze(1)].sum())
    filled = int(plan.slots_used.sum())
    expert_elems = 3 * args.hidden * args.expert_intermediate
    token_bytes = 2 * args.hidden * args.bytes_per_elem
    return {
        "experts": args.experts, "topk": args.topk, "ranks": args.ranks,
        "tokens_per_rank": args.tokens_per_rank, "skew": args.skew, "seed": args.seed,
        "capacity_per_rank": capacity,
        "max_over_mean_static": round(max_over_mean(static_load(counts, args.ranks)), 4),
        "max_over_mean_replicated": round(max_over_mean(plan.rank_load), 4),
        "max_replica_slots_used": int(plan.slots_used.max()),
        "replica_slot_bound": epn,
        "replica_slots_used_total": filled,
        "replica_weight_bytes_per_step": filled * expert_elems * args.bytes_per_elem,
        "replica_grad_bytes_per_step": filled * expert_elems * args.grad_bytes,
        "token_bytes_per_step": remote * token_bytes,
        "token_bytes_per_step_static": remote_static * token_bytes,
        "remote_pair_fraction": round(remote / max(1, int(counts.sum())), 4),
        "planner_ms": round(1e3 * sorted(times)[len(times) // 2], 3),
        "plan_ms_host": round(1e3 * sorted(times)[len(times) // 2], 3),
        "plan_ms_device": round(1e3 * sorted(device_times)[len(device_times) // 2], 3),
        "plan_ops_device": planner_launches(counts, args.ranks, backend="torch"),
        "device_equals_host": device_equal,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m moonep.simulate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent (0 = uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=3584, help="latent width (K3: 3584)")
    ap.add_argument("--expert-intermediate", type=int, default=3072, help="K3: 3072")
    ap.add_argument("--bytes-per-elem", type=int, default=2, help="activations/weights (bf16)")
    ap.add_argument("--grad-bytes", type=int, default=2, help="replica grad element bytes")
    ap.add_argument("--repeats", type=int, default=5, help="planner timings (median)")
    args = ap.parse_args(argv)
    if args.experts % args.ranks:
        ap.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if not 1 <= args.topk <= args.experts:
        ap.error("--topk must be in [1, experts]")
    return args


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # [E, R]-sized tensors: threads only add jitter to planner_ms
    print(json.dumps(simulate(parse_args(argv))))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

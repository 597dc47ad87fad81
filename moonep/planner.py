"""MoonEP replica planner: exact per-rank balance for expert parallelism by replicating experts.

What: every EP rank all-gathers the per-expert token counts of all source ranks, then runs the
same deterministic `plan_replicas` (no further exchange). The plan says how many of each expert's
(token, expert) pairs every rank processes (`alloc [E, R]`) so that rank r gets exactly its share
of the total (``total // R``, plus one for the first ``total % R`` ranks; S*K when every rank
routes S tokens to K experts), holding at most E/R replica experts ("slots") per rank.
`assign_tokens` then maps each pair to (destination rank, GEMM group, row) as contiguous slices of
each expert's token stream, with `torch.searchsorted`; no randomness anywhere.

Algorithm (design doc k3-architecture.md §5.2), home of expert e = rank e // epn, epn = E/R:
1. expert_count[e] = sum over sources; balance[h] = sum of h's home experts - target[h].
2. Receiver quotas, greedy: the most overloaded home group h (max balance, ties: lowest rank) fills
   the rank u with most room (min balance, ties: lowest rank) *completely*: z[h, u] = -balance[u].
   h may overshoot and become a receiver itself; it is then filled later by another group.
3. Inside each donor group, the largest remaining quota (ties: lowest rank) takes from the home
   expert with most remaining tokens (ties: lowest expert id); the home keeps the rest.
Guarantees (checked on every call, a violation raises): token conservation; rank loads equal the
targets exactly; every rank is filled in one step by one remote home group, so it holds at most epn
distinct remote experts, never one of its own (the E/R bound, for *any* counts); a donor never
sends more than it has, because a single step moves at most max(target) <= target[h] + 1 tokens
while balance[h] >= 1, so h keeps >= 0. Identical inputs give identical plans.
Complexity: step 1 O(R_src*E) tensor ops; step 2 at most R heap steps, O(R log R) (every rank is
filled at most once); step 3 at most E + R heap steps, O((E + R) log epn), in Python ints (a
greedy is sequential); assign_tokens O(n log(E*R)) for n pairs; pair_traffic O(R_src*E*R).

`assign_pairs` is `assign_tokens` without validation or host reads (any device), and
`moonep.device_planner.plan_replicas_device` is this planner on the device, bit-equal to it.

Deliberately not here: communication (dispatch, combine, weight fetch, gradient reduce), padding
segments to a token multiple, dedup of a token sent to several experts on one rank. This host
planner is the oracle: its inputs go to the CPU and its greedy steps run in Python ints.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Assignment", "ReplicaPlan", "assign_tokens", "max_over_mean", "pair_traffic",
           "plan_replicas", "rank_targets", "static_load"]


@dataclass
class ReplicaPlan:
    """One step's plan. Home of expert e is rank ``e // experts_per_rank``.

    alloc [E, R] int64: pairs of expert e that rank r processes (home rank included).
    replica_slots [R, epn] int64: global expert id in each replica slot, ascending, -1 = empty.
    rank_load [R] int64: pairs per rank (= rank_targets(total, R)).
    """

    num_experts: int
    num_ranks: int
    experts_per_rank: int
    alloc: Tensor
    replica_slots: Tensor
    rank_load: Tensor
    capacity: int | None = None

    @property
    def slots_used(self) -> Tensor:
        """[R] filled replica slots per rank."""
        return (self.replica_slots >= 0).sum(1)

    def home_experts(self, rank: int) -> Tensor:
        epn = self.experts_per_rank
        return torch.arange(rank * epn, (rank + 1) * epn, dtype=torch.int64,
                            device=self.alloc.device)

    def slot_experts(self, rank: int) -> Tensor:
        """[2*epn] the rank's expert GEMM view: its epn home experts, then its replica slots."""
        return torch.cat([self.home_experts(rank), self.replica_slots[rank]])

    def group_sizes(self, rank: int) -> Tensor:
        """[2*epn] pairs per GEMM group of `slot_experts(rank)` on that rank (0 for empty)."""
        experts = self.slot_experts(rank)
        sizes = self.alloc[experts.clamp(min=0), rank]
        return torch.where(experts >= 0, sizes, torch.zeros_like(sizes))

    def dest_order(self) -> Tensor:
        """[E, R] each expert's fixed destination order: home rank first, then others ascending."""
        e, r, dev = self.num_experts, self.num_ranks, self.alloc.device
        home = torch.arange(e, device=dev) // self.experts_per_rank
        others = torch.arange(r - 1, device=dev).unsqueeze(0)
        others = others + (others >= home.unsqueeze(1)).long()
        return torch.cat([home.unsqueeze(1), others], dim=1)


class Assignment(NamedTuple):
    """Per pair: destination rank, GEMM group on it (index into `slot_experts(dest)`), and row
    offset inside that group's segment."""

    dest_rank: Tensor
    dest_group: Tensor
    dest_offset: Tensor


def rank_targets(total: int, num_ranks: int) -> Tensor:
    """[R] exact per-rank loads: total // R, plus one for the first total % R ranks."""
    t = torch.full((num_ranks,), total // num_ranks, dtype=torch.int64)
    t[: total % num_ranks] += 1
    return t


def static_load(counts: Tensor, num_ranks: int) -> Tensor:
    """[R] pairs per rank without replicas (every expert on its home). counts: [R_src, E] or [E]."""
    per_expert = counts.sum(0) if counts.dim() == 2 else counts
    if per_expert.numel() % num_ranks:
        raise ValueError(f"{per_expert.numel()} experts do not divide over {num_ranks} ranks")
    return per_expert.to(torch.int64).view(num_ranks, -1).sum(1)


def max_over_mean(load: Tensor) -> float:
    """max(load) / mean(load); 1.0 for an all-zero load (nothing to wait for)."""
    mean = load.double().mean().item()
    return 1.0 if mean == 0 else load.double().max().item() / mean


def _check_counts(counts: Tensor) -> Tensor:
    if counts.dim() != 2 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"counts must be an integer [R_src, E] tensor, got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError("counts must be non-negative")
    return counts.to("cpu", torch.int64)


def _receiver_quotas(balance: list[int]) -> list[tuple[int, int, int]]:
    """Step 2: (donor group h, receiver u, amount) moves; each receiver appears exactly once."""
    donors = [(-b, r) for r, b in enumerate(balance) if b > 0]
    receivers = [(b, r) for r, b in enumerate(balance) if b < 0]
    heapq.heapify(donors)
    heapq.heapify(receivers)
    moves = []
    while donors:  # a rank's balance changes only while popped, so heap tops = argmax / argmin
        neg, h = heapq.heappop(donors)
        room, u = heapq.heappop(receivers)  # exists: balances sum to 0 and balance[h] > 0
        moves.append((h, u, -room))
        left = -neg + room
        if left > 0:
            heapq.heappush(donors, (-left, h))
        elif left < 0:  # overshoot: h now has room, filled later by another group
            heapq.heappush(receivers, (left, h))
    return moves


def _split_quotas(expert_count: list[int], epn: int, moves: list[tuple[int, int, int]]
                  ) -> list[tuple[int, int, int]]:
    """Step 3: (expert, receiver, pairs) moves out of each donor group's experts."""
    by_group: dict[int, list[tuple[int, int]]] = {}
    for h, u, amount in moves:
        by_group.setdefault(h, []).append((-amount, u))
    out = []
    for h in sorted(by_group):
        quotas = by_group[h]
        heapq.heapify(quotas)
        experts = [(-expert_count[e], e) for e in range(h * epn, (h + 1) * epn) if expert_count[e]]
        heapq.heapify(experts)
        while quotas:
            neg_q, u = heapq.heappop(quotas)
            neg_r, e = heapq.heappop(experts)  # exists: group h sends at most what it has
            take = min(-neg_q, -neg_r)
            out.append((e, u, take))
            if take < -neg_q:
                heapq.heappush(quotas, (neg_q + take, u))
            if take < -neg_r:
                heapq.heappush(experts, (neg_r + take, e))
    return out


def plan_replicas(counts: Tensor, num_ranks: int, capacity: int | None = None) -> ReplicaPlan:
    """Plan replicas from all ranks' counts [R_src, E] (pairs per expert from each source rank).

    capacity: optional fixed per-rank pair buffer (S*K); ValueError if a target exceeds it.
    Targets are always the exact split of the total (`rank_targets`).
    """
    counts = _check_counts(counts)
    num_experts = counts.shape[1]
    if num_ranks < 1 or num_experts % num_ranks or num_experts == 0:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} ranks")
    epn = num_experts // num_ranks
    expert_count = counts.sum(0)
    total = int(expert_count.sum())
    target = rank_targets(total, num_ranks)
    if capacity is not None and int(target.max()) > capacity:
        raise ValueError(f"capacity {capacity} < balanced load {int(target.max())}")
    balance = (expert_count.view(num_ranks, epn).sum(1) - target).tolist()
    moves = _split_quotas(expert_count.tolist(), epn, _receiver_quotas(balance))

    home = torch.arange(num_experts) // epn
    alloc = torch.zeros(num_experts, num_ranks, dtype=torch.int64)
    alloc[torch.arange(num_experts), home] = expert_count
    if moves:
        e, u, take = torch.tensor(moves, dtype=torch.int64).unbind(1)
        alloc.index_put_((e, u), take, accumulate=True)
        alloc.index_put_((e, home[e]), -take, accumulate=True)
    rank_load = alloc.sum(0)

    remote = (alloc > 0) & (home.unsqueeze(1) != torch.arange(num_ranks))
    rank_idx, expert_idx = remote.t().nonzero(as_tuple=True)  # sorted by rank, then expert
    used = torch.bincount(rank_idx, minlength=num_ranks)
    # Invariants of the algorithm (cheap, O(E*R)); raise rather than `assert` (kept under -O).
    if int(alloc.min()) < 0 or not torch.equal(alloc.sum(1), expert_count):
        raise RuntimeError("MoonEP planner bug: tokens not conserved")
    if not torch.equal(rank_load, target):
        raise RuntimeError("MoonEP planner bug: rank loads differ from targets")
    if int(used.max()) > epn:
        raise RuntimeError(f"MoonEP planner bug: {int(used.max())} replica slots > E/R = {epn}")
    start = torch.cumsum(used, 0) - used
    slots = torch.full((num_ranks, epn), -1, dtype=torch.int64)
    slots[rank_idx, torch.arange(rank_idx.numel()) - start[rank_idx]] = expert_idx
    return ReplicaPlan(num_experts, num_ranks, epn, alloc, slots, rank_load, capacity)


def _cumulative(plan: ReplicaPlan, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(order [E, R], inclusive cumsum of alloc in that order, exclusive cumsum)."""
    if counts.shape[1] != plan.num_experts or not torch.equal(counts.sum(0), plan.alloc.sum(1)):
        raise ValueError("counts are not the counts this plan was made from")
    order = plan.dest_order()
    ordered = plan.alloc.gather(1, order)
    incl = ordered.cumsum(1)
    return order, incl, incl - ordered


def assign_tokens(plan: ReplicaPlan, counts: Tensor, src_rank: int,
                  experts: Tensor | None = None) -> Assignment:
    """Destinations of source rank `src_rank`'s pairs (validated host entry to `assign_pairs`).

    experts: the expert id of each pair in local order (e.g. ``topk_idx.flatten()``; its bincount
    must equal ``counts[src_rank]``); None means the pairs in expert-sorted order (all of expert
    0's, then expert 1's, ...).
    """
    counts = _check_counts(counts)
    row = counts[src_rank]
    if experts is None:
        experts = torch.repeat_interleave(torch.arange(plan.num_experts), row)
    else:
        experts = experts.flatten().to("cpu", torch.int64)
        if not torch.equal(torch.bincount(experts, minlength=plan.num_experts), row):
            raise ValueError("experts do not match counts[src_rank]")
    if not torch.equal(counts.sum(0), plan.alloc.sum(1)):
        raise ValueError("counts are not the counts this plan was made from")
    return assign_pairs(plan, counts, src_rank, experts)


def assign_pairs(plan: ReplicaPlan, counts: Tensor, src_rank: int, experts: Tensor
                 ) -> Assignment:
    """`assign_tokens` without checks or host reads: every input on one device, any device.

    A pair of expert e at global position g of e's stream (ordered by source rank, then local
    order) goes to the first destination d in `plan.dest_order()[e]` with cumsum(alloc) > g, at row
    g - (cumsum before d) of e's segment there: one `searchsorted` over the cumulative allocs laid
    end to end (row e shifted by e * span, span = total + 1 as a device scalar)."""
    counts = counts.to(torch.int64)
    experts = experts.flatten().to(torch.int64)
    dev, E, R, epn = experts.device, plan.num_experts, plan.num_ranks, plan.experts_per_rank
    row = counts[src_rank]
    first = row.cumsum(0) - row
    perm = torch.argsort(experts, stable=True)
    local = torch.empty_like(experts)
    local[perm] = torch.arange(experts.numel(), device=dev) - first[experts[perm]]
    g = counts[:src_rank].sum(0)[experts] + local

    order = plan.dest_order()
    ordered = plan.alloc.gather(1, order)
    incl = ordered.cumsum(1)
    excl = incl - ordered
    span = plan.alloc.sum() + 1  # device scalar: row e of the key space is [e*span, e*span+total]
    flat = (incl + torch.arange(E, device=dev).unsqueeze(1) * span).flatten()
    pos = torch.searchsorted(flat, experts * span + g, right=True) - experts * R
    dest = order[experts, pos]
    offset = g - excl[experts, pos]

    # slot_of[e, r]: replica slot of expert e on rank r; row E absorbs the empty (-1) slots
    slots = plan.replica_slots
    slot_of = torch.full((E + 1, R), -1, dtype=torch.int64, device=dev)
    rank_idx = torch.arange(R, device=dev).unsqueeze(1).expand_as(slots)
    slot_idx = torch.arange(epn, device=dev).expand_as(slots)
    slot_of[torch.where(slots >= 0, slots, E), rank_idx] = slot_idx
    group = torch.where(dest == experts // epn, experts % epn, epn + slot_of[experts, dest])
    return Assignment(dest, group, offset)


def pair_traffic(plan: ReplicaPlan, counts: Tensor) -> Tensor:
    """[R_src, R] pairs each source rank sends to each destination under `assign_tokens` (from
    interval overlaps; no per-pair work). The diagonal stays local."""
    counts = _check_counts(counts)
    order, incl, excl = _cumulative(plan, counts)
    base = counts.cumsum(0) - counts
    out = torch.zeros(counts.shape[0], plan.num_ranks, dtype=torch.int64)
    for s in range(counts.shape[0]):
        lo = base[s].unsqueeze(1)
        hi = lo + counts[s].unsqueeze(1)
        overlap = (torch.minimum(hi, incl) - torch.maximum(lo, excl)).clamp(min=0)
        out[s].index_add_(0, order.flatten(), overlap.flatten())
    return out

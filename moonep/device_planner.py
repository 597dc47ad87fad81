"""MoonEP replica planner on the device: `plan_replicas` without host synchronisation.

What: `plan_replicas_device(counts, R)` returns the same `ReplicaPlan` as `moonep.planner.
plan_replicas` (bit for bit: alloc [E, R], replica_slots [R, epn], rank_load [R], all int64 on
counts.device) plus `ok`, a 0-dim bool tensor that replaces the host planner's raises (token
conservation, alloc >= 0, rank_load == targets, <= epn slots per rank, counts >= 0; also False
if total * max(R, epn) >= 2^61, past the int64 keys of step 3: ~2^49 pairs at E/R = 4096).
Nothing reads tensor data on the host (no .item/.tolist/nonzero/bincount/boolean masks/
data-dependent loop counts), so it runs inside a training step on a GPU; the caller reads `ok`
later, together with other small values. The host planner stays the oracle (the tests compare
the two on ~1300 inputs).

Algorithm (moonep/planner.py, restated as state machines; the heaps there pop exactly argmax /
argmin with lowest-index ties: torch.argmax / min(dim) return the first extremal index, and the
step-3 keys below encode the same order):
1. expert_count[e] = counts.sum(0); target = rank_targets(total, R); balance[h] = sum of h's home
   experts - target[h].
2. Receiver quotas, T2 = R - 1 steps: h = argmax(balance), u = argmin(balance), amount =
   -balance[u]; z[h, u] += amount; balance[h] -= amount; balance[u] = 0. Once no balance is
   positive all balances are 0 (they sum to 0), so amount = 0 and a step changes nothing: no mask.
3. Split quotas over experts, all donor groups h in lockstep, T3 = R + epn - 2 steps (0 if R = 1):
   q[h, :] = z[h, :], c[h, j] = expert_count[h*epn + j]; u = argmax q[h], j = argmax c[h],
   take = min(q[h, u], c[h, j]); alloc[h*epn + j, u] += take; q[h, u] -= take; c[h, j] -= take.
   A finished group has q[h] = 0, so take = 0: again a no-op without a mask. At the end
   alloc[e, home(e)] = c (what the home keeps).
Epilogue (`_finish`): rank_load = alloc.sum(0); replica_slots from the epn experts of each rank's
donor group (the only remote experts it can hold; `ok` verifies that), a cumsum position per
selected one and one scatter into an [R * epn + 1] buffer whose extra element takes every
unselected entry (the only duplicate index) and is dropped.

Iteration bounds (why the fixed counts suffice):
* Step 2: every active step zeroes its receiver u for good (a zero balance is never the argmax
  while a positive one exists, and a rank becomes a receiver again only from a positive balance),
  so each rank is a receiver at most once. The donor h of the last active step ends at 0 (after
  it no balance is positive and they sum to 0), and a rank once zeroed never turns positive, so
  that h was never a receiver: at most R - 1 receivers, hence at most R - 1 active steps.
* Step 3, one group h with n_h quotas (its receivers, n_h <= R - 1 by the above): every active
  step zeroes a quota or an expert (take = the smaller of the two), and a zeroed item is never
  picked again (a positive quota remains while the group is active, and a positive expert too: a
  donor never sends more than it has, moonep/planner.py). The last step zeroes the last quota; if
  all epn experts end at zero, the last expert is zeroed in that same step (no step can follow
  it), so at most n_h + epn - 1 steps, <= R + epn - 2. Groups are independent, so the lockstep
  loop needs the maximum over h: T3 = R + epn - 2 (R = 1: no quotas, T3 = 0). Should the bound
  ever fail, quotas stay unfilled and `ok` turns False (rank_load != target).

Backends: "torch" runs T2 steps of 4 tiny ops (argmax, min, 2 index_add_) and T3 steps of 6
(amax, minimum, 2 bitwise_and, sub, scatter_ on [2, R, W] int64 keys), the moves recorded as
tensors and scattered into alloc once at the end: 4*T2 + 6*T3 + ~80 ops, the same count for any
counts of a shape (789 at E=896, R=64). "triton" runs both greedy steps in one single-program
Triton kernel (moonep/planner_triton.py, imported only then; custom op
`moonep::replica_greedy_`), ~50 ops in all with the memset and the epilogue, torch ops either
way. "auto" = triton for CUDA counts when triton imports, else torch. `planner_launches` counts
what one call dispatches.

Deliberately not: the capacity check of `plan_replicas` (it would need a host read; compare
`plan.rank_load.max()` yourself), data-dependent early exit (that is a host sync).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from moonep.planner import ReplicaPlan

__all__ = ["greedy_steps", "plan_replicas_device", "planner_launches"]

_BACKENDS = ("auto", "torch", "triton")


def greedy_steps(num_experts: int, num_ranks: int) -> tuple[int, int]:
    """(T2, T3): the fixed step counts of the two greedy loops (proof in the module docstring)."""
    epn = num_experts // num_ranks
    return num_ranks - 1, (num_ranks + epn - 2 if num_ranks > 1 else 0)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check(counts: Tensor, num_ranks: int, backend: str) -> None:
    if not isinstance(counts, Tensor) or counts.dim() != 2 or counts.dtype.is_floating_point \
            or counts.dtype.is_complex or counts.dtype == torch.bool:
        what = f"{counts.dtype} {tuple(counts.shape)}" if isinstance(counts, Tensor) else \
            type(counts).__name__
        raise ValueError(f"counts must be an integer [R_src, E] tensor, got {what}")
    num_experts = counts.shape[1]
    if not isinstance(num_ranks, int) or num_ranks < 1 or num_experts == 0 \
            or num_experts % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1 and divide the "
                         f"{num_experts} experts (counts.shape[1])")
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {_BACKENDS}")


def _lane_width(num_experts: int, num_ranks: int) -> int:
    """W of the torch backend's step-3 keys: the least power of two >= max(R, epn)."""
    return 1 << (max(num_ranks, num_experts // num_ranks) - 1).bit_length()


def _targets(total: Tensor, num_ranks: int) -> Tensor:
    """[R] rank_targets(total, R) from a 0-dim device tensor."""
    ranks = torch.arange(num_ranks, device=total.device)
    return total // num_ranks + (ranks < total % num_ranks)


def _greedy_torch(expert_count: Tensor, target: Tensor, num_ranks: int) -> tuple[Tensor, Tensor]:
    """(alloc [E, R], donor [R]) int64 by the two greedy loops, fixed step counts, no host reads.
    donor[u] = the home group that filled rank u in step 2, -1 if none."""
    num_experts = expert_count.numel()
    epn = num_experts // num_ranks
    t2, t3 = greedy_steps(num_experts, num_ranks)
    device = expert_count.device
    balance = expert_count.view(num_ranks, epn).sum(1) - target

    # Step 2. argmax / min(dim) return the first extremal index (documented), = the heap order.
    hs, us, mins = [], [], []
    for _ in range(t2):
        h = balance.argmax(0, keepdim=True)
        mn, u = balance.min(0, keepdim=True)  # mn = -amount <= 0
        balance.index_add_(0, h, mn)  # balance[h] -= amount (h != u while active)
        balance.index_add_(0, u, mn, alpha=-1)  # balance[u] = 0
        hs.append(h)
        us.append(u)
        mins.append(mn)

    # Step 3 state, one int64 key per (side, group, lane): key = value * W + p, side 0 = quotas
    # q[h, u], side 1 = remaining c[h, j], W = a power of two >= max(R, epn), lanes stored
    # reversed (lane i at position p = W - 1 - i). amax then picks the largest value, ties the
    # largest p = the lowest lane (the heap order), and key & (W - 1) is its position. Zero
    # padding lanes (i >= R or >= epn) have lower p than the real lane 0, so they are never
    # picked. (amax, not max(dim)/argmax: ~5x faster on CPU.)
    w = _lane_width(num_experts, num_ranks)
    keys = torch.arange(w, device=device).repeat(2 * num_ranks).view(2, num_ranks, w)
    if t2:  # side 0: key[0, h, W-1-u] += z[h, u] * W; finished steps add 0 at (0, W-1)
        hs, us, mins = torch.cat(hs), torch.cat(us), torch.cat(mins)
        keys.view(-1).index_add_(0, hs * w + (w - 1) - us, mins, alpha=-w)
    c_keys = keys.select(0, 1).narrow(1, w - epn, epn)  # [R, epn] view, lanes reversed
    c_keys.add_(expert_count.view(num_ranks, epn).flip(1), alpha=w)
    bests, takes = [], []
    # 0-dim operands: no scalar wrap per step (and no torch.tensor(..., device): an H2D copy)
    low = torch.full((), w - 1, dtype=torch.int64, device=device)
    high = torch.full((), -w, dtype=torch.int64, device=device)
    for _ in range(t3):
        best = keys.amax(2, keepdim=True)  # [2, R, 1]: keys of q[h, u], c[h, j]
        take = torch.minimum(best.select(0, 0), best.select(0, 1)) & high  # [R, 1]: take * W
        keys.scatter_(2, best & low, best - take)
        bests.append(best)
        takes.append(take)

    alloc = expert_count.new_zeros(num_experts * num_ranks)
    if t3:
        pos = torch.stack(bests) & low  # [T3, 2, R, 1]: W-1-u, W-1-j
        # flat (h*epn + j)*R + u; finished groups (take 0) pick u = j = 0: valid, add 0
        base = torch.arange(num_ranks, device=device).view(1, num_ranks, 1) * (epn * num_ranks)
        flat = (base + (w - 1) * (num_ranks + 1)) - pos.select(1, 0) - pos.select(1, 1) * num_ranks
        alloc.scatter_add_(0, flat.view(-1), torch.stack(takes).view(-1) >> (w.bit_length() - 1))
    alloc = alloc.view(num_experts, num_ranks)
    # alloc[h*epn + j, h] = c[h, j]: the diagonal of the [R, epn, R] view is [epn, R] (j, h);
    # remote takes never land there (u != h), only the 0 adds of finished groups, so add = set
    kept = (c_keys >> (w.bit_length() - 1)).flip(1)  # [R, epn]
    torch.diagonal(alloc.view(num_ranks, epn, num_ranks), dim1=0, dim2=2).add_(kept.t())
    donor = torch.full((num_ranks,), -1, dtype=torch.int64, device=device)
    if t2:  # active steps have mins < 0; finished ones add 0 (each u is filled at most once)
        donor.index_add_(0, us, (hs + 1) * (mins < 0))
    return alloc, donor


def _finish(alloc: Tensor, donor: Tensor, expert_count: Tensor, total: Tensor, target: Tensor,
            counts: Tensor, num_ranks: int) -> tuple[ReplicaPlan, Tensor]:
    """replica_slots, rank_load and the guarantee flag from alloc and donor; sync-free, and only
    O(R * epn) work besides three reductions over alloc.

    Rank u's remote experts with pairs can only be experts of its donor group (step 3 sends
    group h's pairs only to h's receivers), so the slots are read from those epn rows of column
    u. `ok` verifies that claim instead of trusting it: received + kept = rank_load per rank with
    alloc >= 0 means no other remote entry of the column is positive (then the slots equal
    planner.py's nonzero-based ones, and <= epn holds)."""
    num_experts = alloc.shape[0]
    epn = num_experts // num_ranks
    device = alloc.device
    alloc3 = alloc.view(num_ranks, epn, num_ranks)
    rank_load = alloc.sum(0)
    has = donor >= 0
    group = donor.clamp(min=0)
    ranks = torch.arange(num_ranks, device=device)
    experts = group.unsqueeze(1) * epn + torch.arange(epn, device=device)  # [R, epn]
    got = torch.take(alloc, experts * num_ranks + ranks.unsqueeze(1))  # alloc[experts, u]
    sel = (got > 0) & has.unsqueeze(1)
    # slot of a selected expert = its rank among the selected (<= epn of them, ascending id);
    # every unselected entry goes to one extra trailing element (the only duplicate index)
    flat = torch.where(sel, sel.cumsum(1) - 1 + ranks.unsqueeze(1) * epn, num_ranks * epn)
    buf = torch.full((num_ranks * epn + 1,), -1, dtype=torch.int64, device=device)
    buf.scatter_(0, flat.view(-1), experts.view(-1))
    slots = buf.narrow(0, 0, num_ranks * epn).view(num_ranks, epn)
    kept = torch.diagonal(alloc3, dim1=0, dim2=2).sum(0)  # [R] pairs of u's own experts on u
    scalars = [total < 2**61 // _lane_width(num_experts, num_ranks),  # step-3 keys fit int64
               alloc.min() >= 0]
    if counts.numel():  # (the host planner raises on negative counts)
        scalars.append(counts.min() >= 0)
    ok = torch.cat([
        alloc.sum(1) == expert_count,  # conservation
        rank_load == target,  # exact loads
        torch.where(sel, got, 0).sum(1) + kept == rank_load,  # slots = all remote experts
        torch.stack(scalars),
    ]).all()
    return ReplicaPlan(num_experts, num_ranks, epn, alloc, slots, rank_load), ok


def plan_replicas_device(counts: Tensor, num_ranks: int, backend: str = "auto"
                         ) -> tuple[ReplicaPlan, Tensor]:
    """(plan, ok): `plan_replicas(counts, num_ranks)` computed on counts.device, no host sync.

    counts: [R_src, E] integer tensor. Plan tensors are int64 on counts.device, capacity None.
    ok: 0-dim bool tensor, False where `plan_replicas` would raise (or counts < 0); read it later.
    backend: "torch" (tensor ops, fixed step counts), "triton" (one Triton kernel for the greedy
    steps), "auto" (triton for CUDA counts if triton imports, else torch).
    """
    _check(counts, num_ranks, backend)
    if backend == "auto":
        backend = "triton" if counts.is_cuda and _triton_available() else "torch"
    expert_count = counts.sum(0, dtype=torch.int64)
    total = expert_count.sum()
    target = _targets(total, num_ranks)
    if backend == "triton":
        from moonep import planner_triton  # lazy: importing moonep never imports triton

        alloc, donor = planner_triton.replica_greedy(expert_count, target, num_ranks)
    else:
        alloc, donor = _greedy_torch(expert_count, target, num_ranks)
    return _finish(alloc, donor, expert_count, total, target, counts, num_ranks)


class _OpCounter(TorchDispatchMode):
    def __init__(self, views: bool) -> None:
        super().__init__()
        self.views = views
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.views or not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def planner_launches(counts: Tensor, num_ranks: int, backend: str = "auto", *,
                     views: bool = False) -> int:
    """Aten ops one `plan_replicas_device` call dispatches (each a kernel launch or a device
    allocation; the Triton custom op counts as 1). Views launch nothing and are left out unless
    views=True."""
    with _OpCounter(views) as counter:
        plan_replicas_device(counts, num_ranks, backend)
    return counter.count

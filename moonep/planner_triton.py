"""Triton kernel for the two greedy steps of the MoonEP replica planner (one program, grid (1,)).

What: `replica_greedy(expert_count [E], target [R], R) -> (alloc [E, R], donor [R])`, the same
values as `moonep.device_planner._greedy_torch` (and so as `moonep.planner.plan_replicas`): step
2 (receiver quotas, T2 = R - 1 steps over balance [BR]) and step 3 (all donor groups in lockstep,
T3 = R + epn - 2 steps over q [BR, BR] and c [BR, BE]) run in the registers of one program,
BR / BE = next powers of two of R / epn, padding masked so that it is never picked.
Ties: as in the torch backend, every argmax is ONE max over keys value * B + (B - 1 - lane)
(B = BR or BE), i.e. the largest value and among equals the lowest lane, the heap order of
planner.py; key & (B - 1) gives the lane back, key >> log2(B) the value. (One plain reduction
instead of tl.argmax's two-value combine: cheaper on the GPU, and each reduction is a costly
device-function call under the interpreter.) Integers are int64; keys fit while total * B <
2^61, which `ok` checks. Each step-3 take is stored straight into alloc (distinct addresses: a
(group, expert, receiver) triple is taken at most once, finished groups store nothing), the
homes' remainders at the end; the caller zeroes alloc (one memset).

Wrapped as the custom op `moonep::replica_greedy_` (mutates alloc and donor), so dispatch modes
and FakeTensorMode see one node, and `planner_launches` counts the kernel as 1.
This module imports triton; `moonep.device_planner` imports it only for backend="triton".
Under TRITON_INTERPRET=1 (set before this import) it runs on CPU tensors, which is how the tests
check it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moonep.device_planner import greedy_steps

__all__ = ["replica_greedy"]

_BIG = 2**62  # below every key: |key| <= (total + 1) * max(BR, BE) < 2^61 + B <= 2^62 (`ok`)


@triton.jit
def _replica_greedy_kernel(ec_ptr, target_ptr, alloc_ptr, donor_ptr, T2: tl.constexpr,
                           T3: tl.constexpr, R: tl.constexpr, EPN: tl.constexpr, BR: tl.constexpr,
                           BE: tl.constexpr, LOG_BR: tl.constexpr, LOG_BE: tl.constexpr,
                           BIG: tl.constexpr):
    ranks = tl.arange(0, BR)
    rmask = ranks < R
    lanes = tl.arange(0, BE)
    cmask = rmask[:, None] & (lanes < EPN)[None, :]
    rev_r = BR - 1 - ranks  # key = value * B + (B - 1 - lane): max = largest value, lowest lane
    rev_e = BE - 1 - lanes
    # c[h, j] = expert_count[h*epn + j]; balance[h] = sum_j c[h, j] - target[h]
    c = tl.load(ec_ptr + ranks[:, None] * EPN + lanes[None, :], mask=cmask, other=0).to(tl.int64)
    target = tl.load(target_ptr + ranks, mask=rmask, other=0).to(tl.int64)
    bal = tl.sum(c, axis=1) - target

    # Step 2: h = argmax, u = argmin of balance (lowest index ties), one key max each; every
    # receiver u is recorded once, finished steps (all balances 0, mn = 0) record nothing.
    donor = tl.full([BR], -1, tl.int64)
    amount = tl.zeros([BR], tl.int64)
    for _ in range(T2):
        kh = tl.max(tl.where(rmask, bal * BR + rev_r, -BIG), axis=0)
        ku = tl.max(tl.where(rmask, -bal * BR + rev_r, -BIG), axis=0)
        h = BR - 1 - (kh & (BR - 1))
        u = BR - 1 - (ku & (BR - 1))
        mn = -(ku >> LOG_BR)  # = min(balance) = -amount (arithmetic shift: floor)
        bal = tl.where(ranks == h, bal + mn, bal)  # balance[h] -= amount
        bal = tl.where(ranks == u, 0, bal)
        got = (ranks == u) & (mn < 0)
        donor = tl.where(got, h, donor)
        amount = tl.where(got, -mn, amount)

    # Step 3, all groups in lockstep on keys: q[h, u] = amount[u] if donor[u] == h; c as above.
    # Zero padding lanes have lower keys than a real lane 0 and are never picked.
    q = tl.where((donor[None, :] == ranks[:, None]) & rmask[None, :], amount[None, :], 0)
    qk = q * BR + rev_r[None, :]
    ck = c * BE + rev_e[None, :]
    for _ in range(T3):
        qb = tl.max(qk, axis=1)
        cb = tl.max(ck, axis=1)
        take = tl.minimum(qb >> LOG_BR, cb >> LOG_BE)  # 0 for finished groups and padding
        u = BR - 1 - (qb & (BR - 1))
        j = BE - 1 - (cb & (BE - 1))
        qk = tl.where(ranks[None, :] == u[:, None], qk - take[:, None] * BR, qk)
        ck = tl.where(lanes[None, :] == j[:, None], ck - take[:, None] * BE, ck)
        tl.store(alloc_ptr + (ranks * EPN + j) * R + u, take, mask=rmask & (take > 0))
    tl.store(alloc_ptr + (ranks[:, None] * EPN + lanes[None, :]) * R + ranks[:, None],
             ck >> LOG_BE, mask=cmask)
    tl.store(donor_ptr + ranks, donor, mask=rmask)


@torch.library.custom_op("moonep::replica_greedy_", mutates_args=("alloc", "donor"))
def _replica_greedy_op(expert_count: Tensor, target: Tensor, alloc: Tensor,
                       donor: Tensor) -> None:
    num_ranks = target.numel()
    num_experts = expert_count.numel()
    epn = num_experts // num_ranks
    t2, t3 = greedy_steps(num_experts, num_ranks)
    br = triton.next_power_of_2(num_ranks)
    be = triton.next_power_of_2(epn)
    # q [BR, BR] + c [BR, BE] int64 live in registers: <= 32 elements per thread up to BR = 128
    warps = min(32, max(4, triton.next_power_of_2(br * (br + be) // 1024)))
    _replica_greedy_kernel[(1,)](expert_count, target, alloc, donor, T2=t2, T3=t3, R=num_ranks,
                                 EPN=epn, BR=br, BE=be, LOG_BR=br.bit_length() - 1,
                                 LOG_BE=be.bit_length() - 1, BIG=_BIG, num_warps=warps)


@_replica_greedy_op.register_fake
def _(expert_count, target, alloc, donor) -> None:
    return None


def replica_greedy(expert_count: Tensor, target: Tensor, num_ranks: int
                   ) -> tuple[Tensor, Tensor]:
    """(alloc [E, R], donor [R]) int64 from expert_count [E] and target [R] (int64, contiguous,
    same device): the zeroed alloc (one memset) plus the kernel; donor[u] = -1 if none."""
    expert_count = expert_count.contiguous()
    target = target.contiguous()
    alloc = expert_count.new_zeros(expert_count.numel(), num_ranks)
    donor = expert_count.new_empty(num_ranks)
    torch.ops.moonep.replica_greedy_(expert_count, target, alloc, donor)
    return alloc, donor

"""MoonEP expert-parallel dispatcher: the `model.dispatch.LocalDispatcher` contract over EP ranks.

What: `MoonEPDispatcher(group, num_experts, replicas=True, pad_multiple=1)`.
- `dispatch(x [S, l], topk_idx [S, k], topk_weight [S, k])` -> (x_grouped [rows, l],
  group_sizes [G] int64, handle). One all_gather of the [E] per-expert pair counts; every rank then
  computes the same plan (`plan_replicas`, or plain EP: each expert wholly on its home rank
  e // (E/R)) and `assign_tokens` gives each local (token, expert) pair its (rank, GEMM group).
  Pairs are sorted by (dest rank, dest group, local order) and sent with one
  `all_to_all_single` of uneven splits. On the receiver, groups are [epn home experts | epn
  replica slots] (replicas=False: the epn home experts); inside a group rows are ordered by source
  rank, then the source's local pair order (= the planner's stream offset), and each group is
  padded with zero rows to a multiple of `pad_multiple`; group_sizes counts the padded rows.
- the caller runs its grouped GEMM, with weights from `gather_expert_weights(handle, *w)`.
- `combine(y_grouped [rows, l], handle)` -> [S, l] fp32: drop padding, reverse all-to-all,
  un-sort by the inverse permutation, sum_k topk_weight * y in fp32 (no atomics, no index_add).
Gradients: the all-to-alls are `AllToAllRows` (backward = the reverse trip: dispatch's backward
is a combine-like return, combine's backward is a re-dispatch with the saved splits); every
gather/scatter uses unique indices, and a token's k copies are reduced by an expand (sum over k),
so outputs and gradients are bit-identical across runs. The receiver computes its layout from
the plan alone (no second exchange of counts or offsets).

Deliberately not: dedup of a token sent to several experts on one rank, capacity/dropping,
overlap of communication with compute, fp8 token payloads with scales (rows are sent as bytes,
so an fp8 x works, but scales are the caller's business). `moonep` never imports `model/`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moonep.planner import ReplicaPlan, assign_tokens, plan_replicas, static_load
from moonep.replicas import AllToAllRows, ReplicaRoutes, fetch_replicas, replica_routes

__all__ = ["MoonEPDispatcher", "MoonEPHandle", "receive_blocks", "static_plan"]


def _combine_dtype(topk_weight: Tensor) -> Tensor:
    """The routing weights in the combine's accumulation dtype: at least fp32."""
    return topk_weight.to(torch.promote_types(topk_weight.dtype, torch.float32))


def static_plan(counts: Tensor, num_ranks: int) -> ReplicaPlan:
    """Plain EP as a ReplicaPlan: every expert's pairs on its home rank, no replica slots."""
    num_experts = counts.shape[1]
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} ranks")
    epn = num_experts // num_ranks
    expert_count = counts.to("cpu", torch.int64).sum(0)
    alloc = torch.zeros(num_experts, num_ranks, dtype=torch.int64)
    alloc[torch.arange(num_experts), torch.arange(num_experts) // epn] = expert_count
    slots = torch.full((num_ranks, epn), -1, dtype=torch.int64)
    return ReplicaPlan(num_experts, num_ranks, epn, alloc, slots, static_load(counts, num_ranks))


def receive_blocks(plan: ReplicaPlan, counts: Tensor, rank: int, group_experts: Tensor) -> Tensor:
    """[R_src, G] pairs each source rank sends into each GEMM group of `rank`.

    Destination d takes the slice [excl, incl) of expert e's stream (ordered by source, then local
    order; destinations in `plan.dest_order()`); source s owns [base[s, e], base[s, e] +
    counts[s, e]). The overlap is what s sends to d for e. group_experts: [G] expert id per group
    (-1 = empty slot).
    """
    counts = counts.to("cpu", torch.int64)
    order = plan.dest_order()  # [E, R]
    incl = plan.alloc.gather(1, order).cumsum(1)  # [E, R]
    pos = torch.argsort(order, dim=1)[:, rank : rank + 1]  # [E, 1] position of `rank` in order
    hi_d = incl.gather(1, pos).squeeze(1)  # [E]
    lo_d = hi_d - plan.alloc[:, rank]
    base = counts.cumsum(0) - counts  # [R_src, E]
    overlap = (torch.minimum(base + counts, hi_d) - torch.maximum(base, lo_d)).clamp(min=0)
    blocks = overlap[:, group_experts.clamp(min=0)]  # [R_src, G]
    return blocks * (group_experts >= 0)


@dataclass
class MoonEPHandle:
    """What combine and gather_expert_weights need from one dispatch (index tensors on x.device)."""

    plan: ReplicaPlan
    group_experts: Tensor  # [G] global expert id of each GEMM group on this rank (-1 = empty)
    pair_sizes: Tensor  # [G] int64 real (unpadded) pairs per group
    send_order: Tensor  # [S*k] flat (token, k) index of each sent row, in send order
    send_splits: list[int]  # [R] rows sent to each rank
    recv_splits: list[int]  # [R] rows received from each rank
    recv_rows: Tensor  # [n_recv] row of x_grouped that each received row fills
    num_rows: int  # rows of x_grouped (padding included)
    topk_weight: Tensor  # [S, k] fp32
    routes: ReplicaRoutes | None  # replica weight exchange (None without replicas)


class MoonEPDispatcher:
    """Expert parallelism over `group` (R ranks, E/R home experts each) with optional replicas."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, replicas: bool = True,
                 pad_multiple: int = 1) -> None:
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"{num_experts} experts do not divide over {self.num_ranks} ranks")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.num_experts, self.replicas, self.pad_multiple = num_experts, replicas, pad_multiple
        self.experts_per_rank = num_experts // self.num_ranks

    def _gather_counts(self, flat: Tensor) -> Tensor:
        """[R, E] int64 (CPU): every rank's per-expert pair counts (one all_gather)."""
        local = torch.bincount(flat, minlength=self.num_experts).to(torch.int64)  # [E]
        out = [torch.empty_like(local) for _ in range(self.num_ranks)]
        dist.all_gather(out, local, group=self.group)
        return torch.stack(out).cpu()

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
                 ) -> tuple[Tensor, Tensor, MoonEPHandle]:
        S, k = topk_idx.shape
        R, rank, dev = self.num_ranks, self.rank, x.device
        flat = topk_idx.reshape(-1).to(torch.int64)  # [S*k]
        counts = self._gather_counts(flat)  # [R, E]
        plan = plan_replicas(counts, R) if self.replicas else static_plan(counts, R)
        asg = assign_tokens(plan, counts, rank, experts=flat.cpu())
        group_experts = plan.slot_experts(rank) if self.replicas else plan.home_experts(rank)
        G = group_experts.numel()

        # Sender: (dest rank, dest group) key; stable sort keeps local order inside a group.
        send_order = torch.argsort(asg.dest_rank * G + asg.dest_group, stable=True)  # [S*k]
        send_splits = torch.bincount(asg.dest_rank, minlength=R).tolist()

        # Receiver: blocks [R_src, G] arrive source-major; place them group-major with padding.
        blocks = receive_blocks(plan, counts, rank, group_experts)  # [R, G]
        mine = asg.dest_rank == rank
        if not torch.equal(torch.bincount(asg.dest_group[mine], minlength=G), blocks[rank]):
            raise RuntimeError("MoonEP dispatch bug: receive layout disagrees with assign_tokens")
        pair_sizes = blocks.sum(0)  # [G]
        pad = self.pad_multiple
        padded = (pair_sizes + pad - 1) // pad * pad  # [G]
        n_recv = int(blocks.sum())
        block_id = torch.repeat_interleave(torch.arange(R * G), blocks.flatten(),
                                           output_size=n_recv)  # [n_recv] = s * G + j
        block_start = blocks.flatten().cumsum(0) - blocks.flatten()
        src, grp = block_id // G, block_id % G
        before = (blocks.cumsum(0) - blocks)[src, grp]  # rows of group j from sources < s
        recv_rows = ((padded.cumsum(0) - padded)[grp] + before
                     + torch.arange(n_recv) - block_start[block_id])

        # Forward: expanded view + a permutation (unique indices): backward sums over k exactly.
        send_order = send_order.to(dev)
        x_pairs = x.unsqueeze(1).expand(S, k, x.shape[-1])  # [S, k, l] view
        x_send = x_pairs[send_order // k, send_order % k]  # [S*k, l] in send order
        recv_splits = blocks.sum(1).tolist()
        x_recv = AllToAllRows.apply(x_send, recv_splits, send_splits, self.group)  # [n_recv, l]
        recv_rows = recv_rows.to(dev)
        num_rows = int(padded.sum())
        x_grouped = x.new_zeros(num_rows, x.shape[-1]).index_put((recv_rows,), x_recv)

        routes = replica_routes(plan, rank) if self.replicas else None
        handle = MoonEPHandle(plan, group_experts, pair_sizes, send_order, send_splits,
                              recv_splits, recv_rows, num_rows, _combine_dtype(topk_weight), routes)
        return x_grouped, padded.to(dev), handle

    def combine(self, y_grouped: Tensor, handle: MoonEPHandle) -> Tensor:
        """[rows, l] expert outputs in x_grouped's layout -> [S, l] fp32 weighted sum over k."""
        S, k = handle.topk_weight.shape
        y_recv = y_grouped[handle.recv_rows]  # [n_recv, l] padding dropped
        y_back = AllToAllRows.apply(y_recv, handle.send_splits, handle.recv_splits,
                                    self.group)  # [S*k, l] in send order
        inverse = torch.empty_like(handle.send_order)
        inverse[handle.send_order] = torch.arange(S * k, device=y_back.device)
        y_tk = y_back[inverse].view(S, k, y_back.shape[-1])  # [S, k, l] original (token, k) order
        w = handle.topk_weight  # fp32 (fp64 in the float64 verification mode)
        return (y_tk.to(w.dtype) * w.unsqueeze(-1)).sum(1)  # [S, l]

    def gather_expert_weights(self, handle: MoonEPHandle, *local_weights: Tensor
                              ) -> tuple[Tensor, ...]:
        """Home weights [epn, ...] each -> GEMM-view weights [G, ...] (home | replica slots).

        Differentiable: replica gradients are added back into the home weights' gradients.
        Without replicas the local weights are returned unchanged.
        """
        if handle.routes is None:
            return tuple(local_weights)
        return tuple(fetch_replicas(w, handle.routes, self.group) for w in local_weights)

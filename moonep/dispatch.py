"""MoonEP expert-parallel dispatcher: the `model.dispatch.LocalDispatcher` contract over EP ranks.

What: `MoonEPDispatcher(group, num_experts, replicas=True, pad_multiple=1)`.
- `route(topk_idx [S, k])` -> `MoonEPRoute`: everything that follows from the routing alone, on
  the device. One all_gather of the [E] per-expert pair counts; every rank then computes the same
  plan with the device planner (`moonep.device_planner.plan_replicas_device`, or plain EP: each
  expert wholly on its home rank e // (E/R)), `assign_pairs` gives each local (token, expert)
  pair its (rank, GEMM group, row), the receive layout comes from the plan alone
  (`receive_blocks`), and the replica weight routes from the plan's slots. The host reads ONE
  small int64 tensor per call: token split sizes, rows to allocate, replica weight split sizes,
  copy rounds and the planner's guarantee flag (a violation raises here, not silently later).
- `dispatch(x [S, l], topk_idx, topk_weight, route=None)` -> (x_grouped [rows, l], group_sizes
  [G] int64, handle). Pairs are sorted by (dest rank, dest group, local order) and sent with one
  `all_to_all_single` of uneven splits. On the receiver, groups are [epn home experts | epn replica
  slots] (replicas=False: the epn home experts); inside a group rows are ordered by source rank,
  then the source's local pair order (= the planner's stream offset), and each group is padded
  with zero rows to a multiple of `pad_multiple`; group_sizes counts the padded rows. Passing the
  `route` of an earlier identical call (activation-checkpoint recompute) skips the planning, the
  count exchange and the host read.
- the caller runs its grouped GEMM, with weights from `gather_expert_weights(handle, *w)` (one
  all-to-all for all tensors).
- `combine(y_grouped [rows, l], handle)` -> [S, l] fp32: drop padding, reverse all-to-all,
  un-sort by the inverse permutation, sum_k topk_weight * y in fp32 (no atomics, no index_add).
Gradients: the all-to-alls are `AllToAllRows` (backward = the reverse trip: dispatch's backward
is a combine-like return, combine's backward is a re-dispatch with the saved splits); every
gather/scatter uses unique indices, and a token's k copies are reduced by an expand (sum over k),
so outputs and gradients are bit-identical across runs.

Deliberately not: dedup of a token sent to several experts on one rank, capacity/dropping,
overlap of communication with compute inside the dispatcher (the host read is the only wait;
see `model.moe` for what the caller overlaps), fp8 token payloads with scales (rows are sent as
bytes, so an fp8 x works, but scales are the caller's business). `moonep` never imports `model/`.
Time inside the collectives (and the host read that ends the counts' wait) is reported to any
watching `moonep.timing` clock.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moonep import timing
from moonep.device_planner import plan_replicas_device
from moonep.planner import ReplicaPlan, assign_pairs
from moonep.replicas import AllToAllRows, ReplicaRoutes, fetch_replicas, route_sizes

__all__ = ["MoonEPDispatcher", "MoonEPHandle", "MoonEPRoute", "receive_blocks", "static_plan"]


def _all_gather_single(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    """torch >= 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _combine_dtype(topk_weight: Tensor) -> Tensor:
    """The routing weights in the combine's accumulation dtype: at least fp32."""
    return topk_weight.to(torch.promote_types(topk_weight.dtype, torch.float32))


def count_pairs(flat: Tensor, num_experts: int) -> Tensor:
    """[E] int64 pairs per expert by a scatter-add (no host read, unlike bincount)."""
    out = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return out.scatter_add_(0, flat, torch.ones_like(flat))


def static_plan(counts: Tensor, num_ranks: int) -> ReplicaPlan:
    """Plain EP as a ReplicaPlan on counts' device: every expert's pairs on its home rank, no
    replica slots."""
    num_experts = counts.shape[1]
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} ranks")
    epn, dev = num_experts // num_ranks, counts.device
    expert_count = counts.to(torch.int64).sum(0)
    e = torch.arange(num_experts, device=dev)
    alloc = torch.zeros(num_experts, num_ranks, dtype=torch.int64, device=dev)
    alloc[e, e // epn] = expert_count
    slots = torch.full((num_ranks, epn), -1, dtype=torch.int64, device=dev)
    return ReplicaPlan(num_experts, num_ranks, epn, alloc, slots,
                       expert_count.view(num_ranks, epn).sum(1))


def receive_blocks(plan: ReplicaPlan, counts: Tensor, rank: int, group_experts: Tensor) -> Tensor:
    """[R_src, G] pairs each source rank sends into each GEMM group of `rank` (device ops).

    Destination d takes the slice [excl, incl) of expert e's stream (ordered by source, then local
    order; destinations in `plan.dest_order()`); source s owns [base[s, e], base[s, e] +
    counts[s, e]). The overlap is what s sends to d for e. group_experts: [G] expert id per group
    (-1 = empty slot).
    """
    counts = counts.to(torch.int64)
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
class MoonEPRoute:
    """What one dispatch derives from the routing alone (device index tensors, host split sizes);
    an activation-checkpoint recompute reuses it instead of planning again."""

    plan: ReplicaPlan
    group_experts: Tensor  # [G] global expert id of each GEMM group on this rank (-1 = empty)
    pair_sizes: Tensor  # [G] int64 real (unpadded) pairs per group
    padded_sizes: Tensor  # [G] int64 rows per group, padding included
    send_order: Tensor  # [S*k] flat (token, k) index of each sent row, in send order
    send_splits: list[int]  # [R] rows sent to each rank
    recv_splits: list[int]  # [R] rows received from each rank
    recv_rows: Tensor  # [n_recv] row of x_grouped that each received row fills
    num_rows: int  # rows of x_grouped (padding included)
    routes: ReplicaRoutes | None  # replica weight exchange (None without replicas)


@dataclass
class MoonEPHandle:
    """One dispatch: its route (plan, layout, splits) and what combine needs besides."""

    route: MoonEPRoute
    topk_weight: Tensor  # [S, k] fp32
    during_out: Any = None  # what dispatch's `during` returned


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
        """[R, E] int64 on flat's device: every rank's per-expert pair counts (one all_gather)."""
        local = count_pairs(flat, self.num_experts)  # [E]
        out = local.new_empty(self.num_ranks * self.num_experts)
        _all_gather_single(out, local, group=self.group)
        return out.view(self.num_ranks, self.num_experts)

    def _plan(self, counts: Tensor) -> tuple[ReplicaPlan, Tensor]:
        if not self.replicas:
            return static_plan(counts, self.num_ranks), torch.ones((), dtype=torch.bool,
                                                                   device=counts.device)
        # K3_MOONEP_PLANNER=torch|triton|auto picks the device planner's backend (auto: the
        # Triton kernel on CUDA, the tensor loop elsewhere)
        return plan_replicas_device(counts, self.num_ranks,
                                    backend=os.environ.get("K3_MOONEP_PLANNER", "auto"))

    def route(self, topk_idx: Tensor) -> MoonEPRoute:
        """Plan, assign and lay out one call's pairs; one host read (see the module docstring)."""
        R, rank = self.num_ranks, self.rank
        flat = topk_idx.reshape(-1).to(torch.int64)  # [S*k]
        dev = flat.device
        waited = timing.collective_start()  # the wait for other ranks ends at the host read
        counts = self._gather_counts(flat)  # [R, E]
        plan, ok = self._plan(counts)
        asg = assign_pairs(plan, counts, rank, flat)
        group_experts = plan.slot_experts(rank) if self.replicas else plan.home_experts(rank)
        G = group_experts.numel()

        # Sender: (dest rank, dest group) key; stable sort keeps local order inside a group.
        send_order = torch.argsort(asg.dest_rank * G + asg.dest_group, stable=True)  # [S*k]
        send_splits = count_pairs(asg.dest_rank, R)
        # Receiver: blocks [R_src, G] arrive source-major; placed group-major with padding.
        blocks = receive_blocks(plan, counts, rank, group_experts)  # [R, G]
        mine = (asg.dest_rank == rank).long()
        own = torch.zeros(G, dtype=torch.int64, device=dev).scatter_add_(0, asg.dest_group, mine)
        ok = ok & (own == blocks[rank]).all()
        pair_sizes = blocks.sum(0)  # [G]
        pad = self.pad_multiple
        padded = (pair_sizes + pad - 1) // pad * pad  # [G]
        parts = [send_splits, blocks.sum(1), padded.sum().view(1)]
        prep = None
        if self.replicas:
            prep, weight_sizes = route_sizes(plan, rank)
            parts.append(weight_sizes)
        host = torch.cat([*parts, ok.view(1).long()]).tolist()  # the one device-to-host read
        timing.collective_end(waited)
        if not host[-1]:
            raise RuntimeError("MoonEP planner bug: a plan guarantee (conservation, exact loads, "
                               "<= E/R slots) or the receive layout failed on the device")
        send_list, recv_list, num_rows = host[:R], host[R:2 * R], host[2 * R]
        routes = prep.finish(host[2 * R + 1:-1]) if prep is not None else None

        n_recv = sum(recv_list)
        flat_blocks = blocks.flatten()
        block_id = torch.repeat_interleave(torch.arange(R * G, device=dev), flat_blocks,
                                           output_size=n_recv)  # [n_recv] = s * G + j
        block_start = flat_blocks.cumsum(0) - flat_blocks
        src, grp = block_id // G, block_id % G
        before = (blocks.cumsum(0) - blocks)[src, grp]  # rows of group j from sources < s
        recv_rows = ((padded.cumsum(0) - padded)[grp] + before
                     + torch.arange(n_recv, device=dev) - block_start[block_id])
        return MoonEPRoute(plan, group_experts, pair_sizes, padded, send_order, send_list,
                           recv_list, recv_rows, num_rows, routes)

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor,
                 route: MoonEPRoute | None = None, during: Callable[[], Any] | None = None
                 ) -> tuple[Tensor, Tensor, MoonEPHandle]:
        """`during`: work to run while the token all-to-all is in flight (it is launched
        asynchronously around it); its result is `handle.during_out`."""
        S, k = topk_idx.shape
        if route is None:
            route = self.route(topk_idx)
        elif route.send_order.numel() != S * k:
            raise ValueError(f"route is for {route.send_order.numel()} pairs, got {S * k}")
        # Forward: expanded view + a permutation (unique indices): backward sums over k exactly.
        x_pairs = x.unsqueeze(1).expand(S, k, x.shape[-1])  # [S, k, l] view
        order = route.send_order
        x_send = x_pairs[order // k, order % k]  # [S*k, l] in send order
        pending: list | None = [] if during is not None else None
        x_recv = AllToAllRows.apply(x_send, route.recv_splits, route.send_splits,
                                    self.group, pending)  # [n_recv, l]
        during_out = during() if during is not None else None
        waited = timing.collective_start()
        for work in pending or ():
            work.wait()
        timing.collective_end(waited)
        x_grouped = x.new_zeros(route.num_rows, x.shape[-1]).index_put((route.recv_rows,),
                                                                       x_recv)
        handle = MoonEPHandle(route, _combine_dtype(topk_weight), during_out)
        return x_grouped, route.padded_sizes, handle

    def combine(self, y_grouped: Tensor, handle: MoonEPHandle) -> Tensor:
        """[rows, l] expert outputs in x_grouped's layout -> [S, l] fp32 weighted sum over k."""
        route = handle.route
        S, k = handle.topk_weight.shape
        y_recv = y_grouped[route.recv_rows]  # [n_recv, l] padding dropped
        y_back = AllToAllRows.apply(y_recv, route.send_splits, route.recv_splits,
                                    self.group)  # [S*k, l] in send order
        inverse = torch.empty_like(route.send_order)
        inverse[route.send_order] = torch.arange(S * k, device=y_back.device)
        y_tk = y_back[inverse].view(S, k, y_back.shape[-1])  # [S, k, l] original (token, k) order
        w = handle.topk_weight  # fp32 (fp64 in the float64 verification mode)
        return (y_tk.to(w.dtype) * w.unsqueeze(-1)).sum(1)  # [S, l]

    def gather_expert_weights(self, handle: MoonEPHandle, *local_weights: Tensor
                              ) -> tuple[Tensor, ...]:
        """Home weights [epn, ...] each -> GEMM-view weights [G, ...] (home | replica slots).

        Differentiable: replica gradients are added back into the home weights' gradients.
        Without replicas the local weights are returned unchanged.
        """
        if handle.route.routes is None:
            return tuple(local_weights)
        return fetch_replicas(handle.route.routes, self.group, *local_weights)

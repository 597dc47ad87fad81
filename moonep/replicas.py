"""MoonEP communication primitives: a differentiable row all-to-all and the replica weight fetch.

What:
- `all_to_all_rows(t, out_splits, in_splits, group)`: `dist.all_to_all_single` over the rows of
  `t [n, ...]` with uneven split sizes, sent as raw bytes (gloo rejects fp8, and bytes work for
  every dtype on every backend). `AllToAllRows` is its autograd version: backward is the reverse
  all-to-all with the split sizes swapped.
- `replica_routes(plan, rank)`: which home-expert weights this rank sends to which (rank, slot),
  and which of its own replica slots each received row fills.
- `fetch_replicas(w, routes, group)`: differentiable `[epn, ...] -> [2*epn, ...]` =
  cat(home weights, replica-slot weights). Forward: one all-to-all of weight bytes from home ranks
  to the planned slots (empty slots are zeros). Backward: one reverse all-to-all of the replica
  gradients (sent in fp32), ADDED in fp32 in a fixed order (home gradient, then the copies by
  ascending destination rank) into the home experts' gradients, then cast to the weight dtype.
  Replicas are never parameters, so optimizer state and checkpoints only ever see home experts.

Deliberately not: overlap/prefetch of weights across layers, a persistent buffer pool, in-place
gradient reduction into `.grad` (autograd does the accumulation), FSDP integration (callers pass
the unsharded home weights). Every rank of `group` must call these collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AllToAllRows", "ReplicaRoutes", "all_to_all_rows", "fetch_replicas", "replica_routes"]


def all_to_all_rows(t: Tensor, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup | None) -> Tensor:
    """Rows t[sum(in_splits[:i]) : ...] go to rank i; returns [sum(out_splits), *t.shape[1:]]."""
    row_shape = tuple(t.shape[1:])
    row_numel = 1
    for n in row_shape:
        row_numel *= n
    send = t.contiguous().reshape(t.shape[0], row_numel).view(torch.uint8)  # [n, row bytes]
    recv = send.new_empty(sum(out_splits), send.shape[1])
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return recv.view(t.dtype).reshape(sum(out_splits), *row_shape)


class AllToAllRows(torch.autograd.Function):
    """Differentiable `all_to_all_rows`; backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all_rows(t, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(grad, in_splits, out_splits, ctx.group), None, None, None


@dataclass
class ReplicaRoutes:
    """One rank's part of a step's replica weight exchange (all CPU int64 / Python ints).

    send_expert [n_send]: local home-expert index of each weight sent, ordered by destination.
    send_copy [n_send]: how many earlier sends carry the same expert (0 = first copy).
    send_splits [R] / recv_splits [R]: weights sent to / received from each rank.
    recv_slot [n_recv]: replica slot (0..epn-1) each received weight fills, in arrival order.
    """

    experts_per_rank: int
    send_expert: Tensor
    send_copy: Tensor
    send_splits: list[int]
    recv_slot: Tensor
    recv_splits: list[int]


def replica_routes(plan: Any, rank: int) -> ReplicaRoutes:
    """Routes of `rank` under a `moonep.planner.ReplicaPlan` (same on all ranks, no exchange)."""
    slots = plan.replica_slots  # [R, epn] expert id, -1 = empty
    R, epn = plan.num_ranks, plan.experts_per_rank
    dest, slot = (slots >= 0).nonzero(as_tuple=True)  # sorted by (dest rank, slot)
    expert = slots[dest, slot]
    home = expert // epn
    mine = home == rank
    send_expert = expert[mine] - rank * epn  # [n_send] ordered by dest rank
    perm = torch.argsort(send_expert, stable=True)
    ordered = send_expert[perm]
    first = torch.searchsorted(ordered, ordered)  # first index of each expert in sorted order
    send_copy = torch.empty_like(send_expert)
    send_copy[perm] = torch.arange(ordered.numel()) - first
    here = dest == rank
    arrive = torch.argsort(home[here] * epn + slot[here], stable=True)  # by source rank, slot
    return ReplicaRoutes(
        epn, send_expert, send_copy, torch.bincount(dest[mine], minlength=R).tolist(),
        slot[here][arrive], torch.bincount(home[here], minlength=R).tolist())


class FetchReplicas(torch.autograd.Function):
    """[epn, ...] home weights -> [2*epn, ...] home | replica slots; see module docstring."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, routes: ReplicaRoutes,
                group: dist.ProcessGroup | None) -> Tensor:
        ctx.routes, ctx.group = routes, group
        dev = w.device
        send = w[routes.send_expert.to(dev)]  # [n_send, ...]
        recv = all_to_all_rows(send, routes.recv_splits, routes.send_splits, group)
        slots = w.new_zeros(routes.experts_per_rank, *w.shape[1:])  # empty slots stay zero
        slots[routes.recv_slot.to(dev)] = recv
        return torch.cat([w, slots])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        routes, epn = ctx.routes, ctx.routes.experts_per_rank
        dev = grad.device
        grad_recv = grad[epn:][routes.recv_slot.to(dev)].float()  # [n_recv, ...] fp32 on the wire
        grad_send = all_to_all_rows(grad_recv, routes.send_splits, routes.recv_splits, ctx.group)
        acc = grad[:epn].to(torch.float32, copy=True)  # fp32 reduction, as MoonEP does
        expert, copy = routes.send_expert.to(dev), routes.send_copy.to(dev)
        rounds = int(routes.send_copy.max()) + 1 if routes.send_copy.numel() else 0
        for c in range(rounds):  # <= R-1 rounds; unique indices per round: no atomics
            sel = copy == c
            idx = expert[sel]
            acc[idx] = acc[idx] + grad_send[sel]
        return acc.to(grad.dtype), None, None


def fetch_replicas(w: Tensor, routes: ReplicaRoutes, group: dist.ProcessGroup | None) -> Tensor:
    """GEMM-view weights [2*epn, ...] (home experts, then replica slots) from home weights w."""
    if w.shape[0] != routes.experts_per_rank:
        raise ValueError(f"expected [{routes.experts_per_rank}, ...] home weights, got "
                         f"{tuple(w.shape)}")
    return FetchReplicas.apply(w, routes, group)

"""MoonEP communication primitives: a differentiable row all-to-all and the replica weight fetch.

What:
- `all_to_all_rows(t, out_splits, in_splits, group)`: `dist.all_to_all_single` over the rows of
  `t [n, ...]` with uneven split sizes, sent as raw bytes (gloo rejects fp8, and bytes work for
  every dtype on every backend). `AllToAllRows` is its autograd version: backward is the reverse
  all-to-all with the split sizes swapped.
- `route_sizes(plan, rank)` -> (`RoutePrep`, sizes [3R] int64 on the plan's device): which home
  experts this rank sends to which (rank, slot), and which of its own replica slots each received
  weight fills, as device index tensors; `sizes` (weights sent to / received from each rank, sends
  per copy round) is the only part the host needs, and the dispatcher reads it in the same single
  device-to-host transfer as its token split sizes. `RoutePrep.finish(sizes)` -> `ReplicaRoutes`.
- `fetch_replicas(routes, group, *w)`: differentiable `[epn, ...] -> [2*epn, ...]` per tensor =
  cat(home weights, replica-slot weights), all tensors in ONE all-to-all of weight bytes (each
  sent expert is one row: its w1 | w3 | w2 bytes). Empty slots are zeros. Backward: ONE reverse
  all-to-all of the replica gradients in the weights' dtype, ADDED in fp32 (fp64 in the float64
  verification mode) into the home experts' gradients in a fixed order (home gradient, then the
  copies by ascending destination rank, one round per copy with unique indices: no atomics),
  then cast to the weight dtype. Replicas are never parameters, so optimizer state and
  checkpoints only ever see home experts.

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

from moonep import timing

__all__ = ["AllToAllRows", "ReplicaRoutes", "RoutePrep", "all_to_all_rows", "fetch_replicas",
           "route_sizes"]


def all_to_all_rows(t: Tensor, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup | None, pending: list | None = None) -> Tensor:
    """Rows t[sum(in_splits[:i]) : ...] go to rank i; returns [sum(out_splits), *t.shape[1:]].

    pending: launch asynchronously and append the work to this list; the result may be read
    only after `work.wait()` (on CUDA: the current stream waits for the NCCL stream)."""
    row_shape = tuple(t.shape[1:])
    row_numel = 1
    for n in row_shape:
        row_numel *= n
    send = t.contiguous().reshape(t.shape[0], row_numel).view(torch.uint8)  # [n, row bytes]
    recv = send.new_empty(sum(out_splits), send.shape[1])
    waited = timing.collective_start()
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group,
                                  async_op=pending is not None)
    timing.collective_end(waited)
    if pending is not None:
        pending.append(work)
    return recv.view(t.dtype).reshape(sum(out_splits), *row_shape)


class AllToAllRows(torch.autograd.Function):
    """Differentiable `all_to_all_rows`; backward sends gradients back the way rows came
    (synchronously; `pending` makes only the forward asynchronous)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None, pending: list | None = None) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all_rows(t, out_splits, in_splits, group, pending)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(grad, in_splits, out_splits, ctx.group), None, None, None, None


@dataclass
class ReplicaRoutes:
    """One rank's part of a step's replica weight exchange (index tensors on the plan's device).

    send_expert [n_send]: local home-expert index of each weight sent, ordered by destination.
    send_splits [R] / recv_splits [R]: weights sent to / received from each rank (host ints).
    recv_slot [n_recv]: replica slot (0..epn-1) each received weight fills, in arrival order.
    round_order [n_send]: the sends ordered by (copy, destination), copy = how many sends to lower
    ranks carry the same expert; round_sizes: sends per copy (round c = one slice of
    round_order, each expert at most once in it).
    """

    experts_per_rank: int
    send_expert: Tensor
    send_splits: list[int]
    recv_slot: Tensor
    recv_splits: list[int]
    round_order: Tensor
    round_sizes: list[int]


@dataclass
class RoutePrep:
    """`route_sizes`' device half: full-length index tensors, cut by `finish` once the host
    knows the sizes."""

    experts_per_rank: int
    send_entry: Tensor  # [R*epn] flat (dest, slot) entries, this rank's sends first (by dest)
    send_expert: Tensor  # [R*epn] local home expert of each entry in send_entry's order
    round_key: Tensor  # [R*epn] copy * R + dest per entry in send order (non-sends last)
    recv_slot: Tensor  # [epn] this rank's filled slots first, by (source rank, slot)

    def finish(self, sizes: list[int]) -> ReplicaRoutes:
        R = len(sizes) // 3
        send_splits, recv_splits = sizes[:R], sizes[R:2 * R]
        round_sizes = sizes[2 * R:]
        while round_sizes and round_sizes[-1] == 0:
            round_sizes = round_sizes[:-1]
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        round_order = torch.argsort(self.round_key[:n_send], stable=True)
        return ReplicaRoutes(self.experts_per_rank, self.send_expert[:n_send], send_splits,
                             self.recv_slot[:n_recv], recv_splits, round_order, round_sizes)


def route_sizes(plan: Any, rank: int) -> tuple[RoutePrep, Tensor]:
    """`rank`'s replica routes under a `moonep.planner.ReplicaPlan` (same on every rank, no
    exchange), with no host read: (RoutePrep, sizes [3R] = sends per destination | receives per
    source | sends per copy round)."""
    slots = plan.replica_slots  # [R, epn] expert id, -1 = empty
    R, epn, dev = plan.num_ranks, plan.experts_per_rank, slots.device
    valid = slots >= 0
    home = torch.where(valid, slots // epn, -1)
    mine = home == rank  # [R, epn]: entries (dest, slot) holding one of my experts
    entry = torch.arange(R * epn, device=dev)
    send_entry = torch.argsort(torch.where(mine.flatten(), entry, R * epn + entry))
    local = torch.where(mine, slots - rank * epn, epn)  # [R, epn]; epn = not mine
    # copy index of (dest d, expert e): sends of e to ranks < d (each rank holds e at most once)
    present = torch.zeros(epn + 1, R, dtype=torch.int64, device=dev)
    present[local, torch.arange(R, device=dev).unsqueeze(1).expand_as(local)] = 1
    copy = (present.cumsum(1) - present).gather(0, local.t().contiguous()).t()  # [R, epn]
    dest = entry // epn
    round_key = torch.where(mine.flatten(), copy.flatten() * R + dest, R * R + entry)
    rounds = torch.zeros(R, dtype=torch.int64, device=dev).scatter_add_(
        0, copy.flatten().clamp(max=R - 1), mine.flatten().long())
    mine_recv = valid[rank]  # [epn]
    src = home[rank]
    slot = torch.arange(epn, device=dev)
    recv_slot = torch.argsort(torch.where(mine_recv, src * epn + slot, R * epn + slot))
    recv_splits = torch.zeros(R, dtype=torch.int64, device=dev).scatter_add_(
        0, src.clamp(min=0), mine_recv.long())
    sizes = torch.cat([mine.sum(1), recv_splits, rounds])
    prep = RoutePrep(epn, send_entry, local.flatten()[send_entry], round_key[send_entry],
                     recv_slot)
    return prep, sizes


class FetchReplicas(torch.autograd.Function):
    """[epn, ...] home weights -> [2*epn, ...] home | replica slots, per tensor; see the module
    docstring."""

    @staticmethod
    def forward(ctx: Any, routes: ReplicaRoutes, group: dist.ProcessGroup | None,
                *ws: Tensor) -> tuple[Tensor, ...]:
        ctx.routes, ctx.group = routes, group
        ctx.shapes = [tuple(w.shape[1:]) for w in ws]
        epn, n_send = routes.experts_per_rank, routes.send_expert.numel()
        send = torch.cat([w[routes.send_expert].reshape(n_send, w[0].numel()) for w in ws],
                         dim=1)
        recv = all_to_all_rows(send, routes.recv_splits, routes.send_splits, group)
        out, col = [], 0
        for w in ws:
            width = w[0].numel()
            slots = w.new_zeros(epn, *w.shape[1:])  # empty slots stay zero
            part = recv[:, col:col + width]
            slots[routes.recv_slot] = part.reshape(part.shape[0], *w.shape[1:])
            out.append(torch.cat([w, slots]))
            col += width
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        routes, epn = ctx.routes, ctx.routes.experts_per_rank
        n_recv = routes.recv_slot.numel()
        grad_recv = torch.cat([g[epn:][routes.recv_slot].reshape(n_recv, g[0].numel())
                               for g in grads], dim=1)  # in the weights' dtype on the wire
        grad_send = all_to_all_rows(grad_recv, routes.send_splits, routes.recv_splits, ctx.group)
        out, col = [], 0
        for g, shape in zip(grads, ctx.shapes):
            width = g[0].numel()
            acc = g[:epn].to(torch.promote_types(g.dtype, torch.float32), copy=True)
            start = 0
            for size in routes.round_sizes:  # <= R-1 rounds; unique experts per round
                rows = routes.round_order[start:start + size]
                idx = routes.send_expert[rows]
                part = grad_send[rows, col:col + width].reshape(size, *shape)
                acc[idx] = acc[idx] + part.to(acc.dtype)
                start += size
            out.append(acc.to(g.dtype))
            col += width
        return (None, None, *out)


def fetch_replicas(routes: ReplicaRoutes, group: dist.ProcessGroup | None,
                   *ws: Tensor) -> tuple[Tensor, ...]:
    """GEMM-view weights [2*epn, ...] (home experts, then replica slots) per home tensor w
    [epn, ...]; all tensors share a dtype and travel in one all-to-all."""
    for w in ws:
        if w.shape[0] != routes.experts_per_rank:
            raise ValueError(f"expected [{routes.experts_per_rank}, ...] home weights, got "
                             f"{tuple(w.shape)}")
        if w.dtype != ws[0].dtype:
            raise ValueError(f"replica weights must share a dtype, got {w.dtype} and "
                             f"{ws[0].dtype}")
    return FetchReplicas.apply(routes, group, *ws)

"""Muon over sharded parameters: each matrix orthogonalised where whole blocks of it live, or
once per TP shard group on one owner rank; never gathered over the whole mesh.

FSDP2 shards a tensor along dim 0 (`Shard(0)`; `_StridedShard(0)` on top of TP's dim-0 split),
rank r of its mesh dim holding rows [start_r, end_r) (torch.chunk's split: ceil(rows / n) rows
per rank, the last ranks shorter or empty) of what that dim sees: the whole matrix, or TP's
shard of it. `route` sorts each Muon matrix:
- "local": every rank's rows are whole Muon blocks (a stack of experts split along E under EP
  and FSDP; heads whose row count divides the chunk; TP's per-head q/k/v blocks); each rank
  orthogonalises its own blocks with no communication;
- "owner": the others, in one exchange per mesh:
  1. every rank sends, in one `all_to_all_single` over the FSDP dim, its rows of each such
     matrix to the matrix's owner (owners chosen once, largest Newton-Schulz cost first onto
     the least-loaded rank; the same on every tp rank, as they depend on shapes only);
  2. the owners of a matrix TP also splits (output projections and MLPs: TP's shard is not
     whole blocks) join its TP shards in one `all_gather` over tp among themselves
     (`gather_inner`); each owner runs the batched Newton-Schulz of `train.optim.muon` on its
     matrices' blocks and scales them (the AdamW-RMS-matched learning rate of each block's
     shape), keeping its TP shard of the result (`inner_part`);
  3. a second `all_to_all_single` returns each rank its rows of the updates.
  Split sizes come from shapes only, so nothing waits on data; `OwnerExchange.exchange_bytes`
  counts what a rank sends. Ranks that hold the same shards (HSDP replicas) repeat the same
  exchange in their own shard group, and TP-replicated matrices in each tp rank's.
- "gather": TP alone splitting a matrix along dim 1 (no FSDP over it), or a placement none of
  the above describes: the update is all-gathered over the parameter's mesh
  (`DTensor.full_tensor`), orthogonalised on each of its ranks alike, and each keeps its slice
  (`local_part`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

Tensor = torch.Tensor


def row_ranges(rows: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of n ranks for dim-0 sharding (torch.chunk / DTensor Shard(0))."""
    chunk = -(-rows // n) if rows else 0
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(n)]


@dataclass(frozen=True)
class Route:
    """How a Muon matrix's update is orthogonalised (module docstring).

    kind: "local" (every rank holds whole blocks), "owner" (the owner exchange over mesh dim
    `outer`, then, when `inner` is set, an all-gather over mesh dim `inner` among the owners,
    whose shards it joins along tensor dim `inner_dim`) or "gather" (the whole matrix gathered
    on every rank: any other placement). `shape`: what the owner exchange assembles (the
    parameter's shape over its `inner` shard)."""

    kind: str
    outer: int | None = None
    inner: int | None = None
    inner_dim: int = 0
    shape: tuple[int, ...] = ()


def route(p: Tensor, tile: int) -> Route:
    """The route of matrix `p` whose Muon blocks are `tile` dim-0 entries each (rows of a
    matrix; 1 for a stack of experts, each expert being a block)."""
    dims = _split_dims(p)
    if not dims:
        return Route("local")
    mesh, shape = p.device_mesh, tuple(p.shape)
    if len(dims) == 1:
        (m,) = dims
        pl = p.placements[m]
        if not (isinstance(pl, Shard) and not _strided(pl) and pl.dim == 0):
            return Route("gather")
        if _aligned(shape[0], mesh.size(m), tile):
            return Route("local")
        return Route("owner", outer=m, shape=shape)
    if len(dims) == 2:
        f, i = dims
        pf, pi, ni = p.placements[f], p.placements[i], mesh.size(i)
        if isinstance(pi, Shard) and not _strided(pi) and shape[pi.dim] % ni == 0 and (
                (_strided(pf) and pf.dim == 0 and pi.dim == 0 and pf.split_factor == ni)
                or (isinstance(pf, Shard) and not _strided(pf) and pf.dim == 0 and pi.dim)):
            k = pi.dim
            part = tuple(n // ni if d == k else n for d, n in enumerate(shape))
            whole = k == 0 and part[0] % tile == 0
            if whole and _aligned(part[0], mesh.size(f), tile):
                return Route("local")
            return Route("owner", outer=f, inner=None if whole else i, inner_dim=k, shape=part)
    return Route("gather")


def _strided(pl) -> bool:
    """FSDP2's dim-0 sharding of a tensor TP already split along dim 0 (a Shard subclass in
    some torch versions, not in others)."""
    return isinstance(pl, _StridedShard)


def _aligned(rows: int, n: int, tile: int) -> bool:
    """Whether each of n ranks' dim-0 chunks of `rows` is whole blocks of `tile`."""
    return all(a % tile == 0 and b % tile == 0 for a, b in row_ranges(rows, n))


def _split_dims(p: Tensor) -> list[int]:
    """Mesh dims that really split a DTensor: not replicated, more than one rank (FSDP over a
    single data rank wraps TP's parameters in a size-1 Shard(0) that splits nothing)."""
    if not isinstance(p, DTensor):
        return []
    return [i for i, pl in enumerate(p.placements)
            if not pl.is_replicate() and p.device_mesh.size(i) > 1]


def gather_inner(parts: list[Tensor], mesh, inner: int, dims: list[int]) -> list[Tensor]:
    """Each part's shards over mesh dim `inner` joined along its tensor dim (one all_gather
    for all of them; every rank of the group passes parts of the same shapes)."""
    n = mesh.size(inner)
    flat = torch.cat([t.reshape(-1) for t in parts])
    out = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(out, flat, group=mesh.get_group(inner))
    joined, start = [], 0
    for t, k in zip(parts, dims):
        joined.append(torch.cat([o[start:start + t.numel()].view(t.shape) for o in out], dim=k))
        start += t.numel()
    return joined


def inner_part(full: Tensor, mesh, inner: int, dim: int) -> Tensor:
    """This rank's shard of `full` over mesh dim `inner` (inverse of `gather_inner`)."""
    return full.chunk(mesh.size(inner), dim=dim)[mesh.get_local_rank(inner)]


def local_part(full: Tensor, like: DTensor) -> Tensor:
    """This rank's piece of `full` in `like`'s placements (a local slice, no communication)."""
    mesh = like.device_mesh
    rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, like.placements).to_local()


class OwnerExchange:
    """The owner-path step for the matrices of one shard group (module docstring)."""

    def __init__(self, group, shapes: list[tuple[int, ...]], costs: list[float],
                 inner_sends: list[int] | None = None) -> None:
        self.group = group
        self.inner_sends = inner_sends or [0] * len(shapes)  # elements, by the owner
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = shapes
        self.ranges = [row_ranges(s[0], self.n) for s in shapes]
        load = [0.0] * self.n
        self.owner = [0] * len(shapes)
        for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
            o = min(range(self.n), key=lambda r: (load[r], r))
            self.owner[i] = o
            load[o] += costs[i]

    def _numel(self, i: int, r: int) -> int:
        a, b = self.ranges[i][r]
        return (b - a) * math.prod(self.shapes[i][1:])

    def exchange_bytes(self, itemsize: int, rank: int | None = None) -> int:
        """Bytes `rank` (default: this one) of the group sends per step (both exchanges and
        the owners' all-gathers over the inner dim)."""
        me = self.rank if rank is None else rank
        out = 0
        for i in range(len(self.shapes)):
            if self.owner[i] != me:
                out += self._numel(i, me)  # its rows to the owner
            else:  # the other ranks' rows back, and the all-gather among the owners
                out += sum(self._numel(i, r) for r in range(self.n) if r != me)
                out += self.inner_sends[i]
        return out * itemsize

    def step(self, locals_: list[Tensor],
             orthogonalise: Callable[[list[int], list[Tensor]], list[Tensor]]) -> list[Tensor]:
        """locals_[i]: this rank's rows of matrix i's update -> its rows of the final delta.
        `orthogonalise(owned indices, their full updates) -> their deltas` runs on owners."""
        like = locals_[0]
        mine = [i for i, o in enumerate(self.owner) if o == self.rank]
        send = [[locals_[i].reshape(-1) for i in range(len(locals_)) if self.owner[i] == o]
                for o in range(self.n)]
        send_sizes = [sum(t.numel() for t in parts) for parts in send]
        recv_sizes = [sum(self._numel(i, r) for i in mine) for r in range(self.n)]
        recv = self._all_to_all([t for parts in send for t in parts], send_sizes, recv_sizes,
                                like)
        pieces = list(recv.split(recv_sizes))
        full = []
        cursor = [0] * self.n
        for i in mine:
            rows = []
            for r in range(self.n):
                k = self._numel(i, r)
                a, b = self.ranges[i][r]
                rows.append(pieces[r][cursor[r]:cursor[r] + k].view(b - a, *self.shapes[i][1:]))
                cursor[r] += k
            full.append(torch.cat(rows))
        deltas = orthogonalise(mine, full) if full else []
        back = [[d[slice(*self.ranges[i][r])].reshape(-1) for i, d in zip(mine, deltas)]
                for r in range(self.n)]
        from_owner = [sum(self._numel(i, self.rank) for i in range(len(self.shapes))
                          if self.owner[i] == o) for o in range(self.n)]
        got = self._all_to_all([t for parts in back for t in parts],
                               [sum(t.numel() for t in parts) for parts in back], from_owner,
                               like)
        starts = list(itertools.accumulate([0, *from_owner[:-1]]))
        out: list[Tensor] = []
        for i in range(len(locals_)):  # owner o's pieces arrive in matrix order
            o, k = self.owner[i], self._numel(i, self.rank)
            out.append(got[starts[o]:starts[o] + k].view(locals_[i].shape))
            starts[o] += k
        return out

    def _all_to_all(self, parts: list[Tensor], send_sizes: list[int], recv_sizes: list[int],
                    like: Tensor) -> Tensor:
        flat = torch.cat(parts) if parts else like.new_empty(0)
        recv = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, flat.contiguous(), recv_sizes, send_sizes, group=self.group)
        return recv

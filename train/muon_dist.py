"""Muon over FSDP-sharded parameters: each matrix orthogonalised once, on one owner rank.

A parameter sharded along dim 0 (FSDP2's `Shard(0)` on one mesh dim, replicated on the others)
holds rows [start_r, end_r) on rank r of that dim (torch.chunk's split: ceil(rows / n) rows per
rank, the last ranks shorter or empty). Where every rank's rows are whole Muon blocks (a stack
of experts [E, out, in] split along E, or heads whose row count divides the chunk), each rank
orthogonalises its own blocks with no communication. The others go to an owner:
1. every rank sends, in one `all_to_all_single`, its rows of each such matrix to the matrix's
   owner (owners chosen once, largest Newton-Schulz cost first onto the least-loaded rank);
2. each owner assembles its matrices, runs the batched Newton-Schulz of `train.muon` on their
   blocks and scales them (the AdamW-RMS-matched learning rate of each block's shape);
3. a second `all_to_all_single` returns each rank its rows of the updates.
Split sizes come from shapes only, so nothing waits on data. Bytes moved per rank and step:
twice (n - 1) / n of its rows of the owner-path matrices (`exchange_bytes`). Ranks that hold
the same shards (HSDP replicas) repeat the same exchange in their own shard group.

Any other placement (tensor parallelism's column sharding of output projections, FSDP x TP's
2-D sharding, experts under EP x FSDP) takes the gather path: the update is all-gathered over
the parameter's mesh (`DTensor.full_tensor`), orthogonalised on every rank of it alike, and
each rank keeps its slice (`local_part`). Row-sharded TP matrices whose rows are whole heads
(KDA q/k/v, MLA q and kv_b) and expert stacks split along the experts stay local.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

Tensor = torch.Tensor


def row_ranges(rows: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of n ranks for dim-0 sharding (torch.chunk / DTensor Shard(0))."""
    chunk = -(-rows // n) if rows else 0
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(n)]


def shard_dim(p: Tensor) -> int | None:
    """The mesh dim of a DTensor sharded along dim 0 on exactly one mesh dim (FSDP; TP's row
    sharding); None for plain or replicated tensors and for any other placement (see
    `needs_gather`)."""
    dims = _split_dims(p)
    if len(dims) != 1:
        return None
    pl = p.placements[dims[0]]
    return dims[0] if pl.is_shard() and pl.dim == 0 else None


def _split_dims(p: Tensor) -> list[int]:
    """Mesh dims that really split a DTensor: not replicated, more than one rank (FSDP over a
    single data rank wraps TP's parameters in a size-1 Shard(0) that splits nothing)."""
    if not isinstance(p, DTensor):
        return []
    return [i for i, pl in enumerate(p.placements)
            if not pl.is_replicate() and p.device_mesh.size(i) > 1]


def needs_gather(p: Tensor) -> bool:
    """A DTensor split some other way (TP's column sharding, FSDP x TP, experts under EP x
    FSDP): its update is orthogonalised on the gathered matrix."""
    return bool(_split_dims(p)) and shard_dim(p) is None


def local_part(full: Tensor, like: DTensor) -> Tensor:
    """This rank's piece of `full` in `like`'s placements (a local slice, no communication)."""
    mesh = like.device_mesh
    rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, like.placements).to_local()


class OwnerExchange:
    """The owner-path step for the matrices of one shard group (module docstring)."""

    def __init__(self, group, shapes: list[torch.Size], costs: list[float]) -> None:
        self.group = group
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
        """Bytes `rank` (default: this one) of the group sends per step (both exchanges)."""
        me = self.rank if rank is None else rank
        out = 0
        for i in range(len(self.shapes)):
            if self.owner[i] != me:
                out += self._numel(i, me)  # its rows to the owner
            else:
                out += sum(self._numel(i, r) for r in range(self.n) if r != me)
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

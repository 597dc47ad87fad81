"""Document boundaries of a packed batch, computed once per forward and shared by all layers.

A batch is `input_ids [B, T]`; documents are described by `cu_seqlens` over the flattened B*T
tokens (FlashAttention/fla convention) and must start a new document at every row start. With
`cu_seqlens=None` every row is one document. KDA state, short convolutions and MLA attention
all reset at document starts, so a packed batch computes exactly what each document would alone.

Nothing here reads tensor data on the host: `cu_seqlens` is validated on its host copy before
it moves (`Packing.from_host`, `check_cu_seqlens`), and the per-token views (`doc_ids`,
`pos_in_doc`) come from `searchsorted`, so a GPU never waits for the CPU inside the model.
`cu_seqlens` may end in empty documents (repeats of B*T): pipeline stages receive each
micro-batch's boundaries padded to one width per step.

Context parallelism (`Packing.shard(rank, size)`): each of `size` ranks holds tokens
[rank * T / size, (rank + 1) * T / size) of every row. The shard's `Packing` keeps the full
rows' document numbering (documents outside the shard become empty ones), so per-document
states index the same way on every rank, and `ContextShard` says which document enters the
shard from the previous rank and which leaves it for the next: what KDA's state passing and
the short convolution's halo need. Attention over the whole row reads `context.full`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] integer document ids (a change marks a boundary) -> cu_seqlens [N+1] int32.

    Host-side helper for the data loader (its output length depends on the data)."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # [B, T]
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()  # [N]
    end = torch.tensor([B * T], device=doc_ids.device)
    return torch.cat([idx, end]).to(torch.int32)


def max_seqlen_bucket(longest: int, seqlen: int) -> int:
    """The next power of two >= longest, at most seqlen: a valid bound on the longest document
    (varlen attention only sizes its grid with it) taking log2(seqlen) values at most."""
    return min(seqlen, 1 << max(0, int(longest) - 1).bit_length())


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> int:
    """Validate host `cu_seqlens` for a [batch, seqlen] batch; returns the longest document.

    One read of the host tensor (`tolist`), then plain Python. One-line ValueError naming the
    fix for boundaries that do not cover the batch, decrease, or let a document cross a row."""
    cu = cu_seqlens.detach().flatten().tolist()
    n = batch * seqlen
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n:
        raise ValueError(f"cu_seqlens must run from 0 to B*T={n}, got {cu[:8]}...")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if min(lengths) < 0:
        raise ValueError("cu_seqlens must not decrease")
    if not set(range(0, n, seqlen)) <= set(cu):
        raise ValueError("cu_seqlens must contain every row start (multiples of T): "
                         "documents may not cross rows of the batch")
    return max(lengths)


def pad_cu_seqlens(cu_list: list[torch.Tensor], total: int) -> torch.Tensor:
    """Host cu_seqlens of several micro-batches -> [n, W] int32, each row padded with `total`
    (empty trailing documents) to the widest."""
    width = max(int(c.numel()) for c in cu_list)
    out = torch.full((len(cu_list), width), total, dtype=torch.int32)
    for i, c in enumerate(cu_list):
        out[i, :c.numel()] = c.to(torch.int32)
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> `device`: pinned and non-blocking on CUDA, so the copy does not stall."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def shard_window(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[B, T, ...] whole rows -> the contiguous slice [rank T / size, (rank + 1) T / size)."""
    L = x.shape[1] // size
    return x[:, rank * L:(rank + 1) * L]


@dataclass(frozen=True)
class ContextShard:
    """Where a context-parallel shard sits in its rows (`Packing.shard`).

    `rank`, `size`: this shard of `size`; `start`: its first token's position in the row;
    `full`: the `Packing` of the whole rows; `first_doc` / `last_doc` [B] int64: the document of
    each row's first / last local token; `carry` [B] bool: the first local token continues a
    document from the previous shard (False at rank 0: rows start documents)."""

    rank: int
    size: int
    start: int
    full: Packing
    first_doc: torch.Tensor
    last_doc: torch.Tensor
    carry: torch.Tensor


class Packing:
    """Per-forward view of document boundaries for a [B, T] batch.

    `cu_seqlens`: int32 [N+1] on `device` (None: one document per row); `max_seqlen`: a host
    int >= the longest document (default T: always a valid bound); `cu_seqlens_cpu`: the host
    copy when the caller has one (lets library kernels skip their own device-to-host read).
    `doc_ids` [B, T] int64: document index of each token (0..N-1 over the whole batch);
    `pos_in_doc` [B, T] int64: its position inside the document. Both are computed here, once:
    the layers only read tensors off this object (no lazy caching inside a compiled region, where
    writing an attribute would break the graph). The constructor never reads tensor data;
    `from_host` validates first.
    """

    def __init__(self, batch: int, seqlen: int, device: torch.device | str,
                 cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                 cu_seqlens_cpu: torch.Tensor | None = None) -> None:
        self.batch, self.seqlen, self.device = batch, seqlen, torch.device(device)
        if cu_seqlens is not None and (cu_seqlens.device != self.device
                                       or cu_seqlens.dtype != torch.int32):
            cu_seqlens = to_device(cu_seqlens.to(torch.int32), self.device)
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = seqlen if max_seqlen is None else int(max_seqlen)
        self.cu_seqlens_cpu = cu_seqlens_cpu
        self.doc_ids, self.pos_in_doc = self._doc_views()
        self.context: ContextShard | None = None  # set on a context-parallel shard (`shard`)

    @classmethod
    def from_host(cls, cu_seqlens: torch.Tensor | None, batch: int, seqlen: int,
                  device: torch.device | str, bucket: bool = False) -> Packing:
        """Validate host `cu_seqlens`, record its longest document, copy it to `device`.

        bucket: round the longest document up with `max_seqlen_bucket` (compiled layers bake
        the host int into their graph: a new value every step would recompile them)."""
        if cu_seqlens is None:
            return cls(batch, seqlen, device)
        cu = cu_seqlens.detach().to("cpu", torch.int32)
        longest = check_cu_seqlens(cu, batch, seqlen)
        if bucket:
            longest = max_seqlen_bucket(longest, seqlen)
        return cls(batch, seqlen, device, to_device(cu, torch.device(device)), longest, cu)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def shard(self, rank: int, size: int) -> Packing:
        """This rank's contiguous slice of every row, as a packed `Packing` of [B, T / size]
        tokens. Its `cu_seqlens` is the full rows' boundaries mapped into the slice (clamped:
        documents outside it become empty, so document n is the same document on every rank),
        its `pos_in_doc` the tokens' positions in their whole documents, and `context` the
        shard's place (`ContextShard`). Shapes only: nothing is read on the host."""
        B, T = self.batch, self.seqlen
        if T % size:
            raise ValueError(f"sequence length {T} is not divisible by {size} context shards")
        L = T // size
        start = rank * L
        cu = self.cu_seqlens
        if cu is None:  # one document per row
            cu = torch.arange(0, B * T + 1, T, device=self.device, dtype=torch.int32)

        def into_slice(c: torch.Tensor) -> torch.Tensor:  # monotone: a valid cu_seqlens
            c = c.to(torch.int64)
            row = torch.div(c, T, rounding_mode="floor").clamp(max=B - 1)
            return (row * L + (c - row * T - start).clamp(0, L)).to(torch.int32)

        cpu = None if self.cu_seqlens_cpu is None else into_slice(self.cu_seqlens_cpu)
        out = Packing(B, L, self.device, into_slice(cu), min(self.max_seqlen, L), cpu)
        window = slice(start, start + L)
        out.pos_in_doc = self.pos_in_doc[:, window]  # positions in the whole documents
        out.context = ContextShard(rank, size, start, self, out.doc_ids[:, 0], out.doc_ids[:, -1],
                                   out.pos_in_doc[:, 0] > 0)
        return out

    def window(self, x: torch.Tensor) -> torch.Tensor:
        """A [B, T, ...] tensor of the whole rows -> this shard's tokens (itself without
        context parallelism)."""
        if self.context is None:
            return x
        return shard_window(x, self.context.rank, self.context.size)

    def _doc_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc_ids, pos_in_doc) [B, T] int64, from shapes and device tensors only."""
        B, T = self.batch, self.seqlen
        tok = torch.arange(B * T, device=self.device)
        if self.cu_seqlens is None:
            return (tok // T).view(B, T), (tok % T).view(B, T)
        ids = torch.searchsorted(self.cu_seqlens[1:], tok.to(torch.int32), right=True)
        starts = self.cu_seqlens[:-1].long()
        return ids.view(B, T), (tok - starts[ids]).view(B, T)

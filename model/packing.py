"""Document boundaries of a packed batch, computed once per forward and shared by all layers.

A batch is `input_ids [B, T]`; documents are described by `cu_seqlens` over the flattened B*T
tokens (FlashAttention/fla convention) and must start a new document at every row start. With
`cu_seqlens=None` every row is one document. KDA state, short convolutions and the MLA mask all
reset at document starts, so a packed batch computes exactly what each document would alone.
"""

from __future__ import annotations

from functools import cached_property

import torch


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] integer document ids (a change marks a boundary) -> cu_seqlens [N+1] int32."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # [B, T]
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = torch.nonzero(starts.flatten()).flatten()  # [N]
    end = torch.tensor([B * T], device=doc_ids.device)
    return torch.cat([idx, end]).to(torch.int32)


class Packing:
    """Per-forward view of document boundaries for a [B, T] batch."""

    def __init__(self, batch: int, seqlen: int, device: torch.device,
                 cu_seqlens: torch.Tensor | None = None) -> None:
        self.batch, self.seqlen, self.device = batch, seqlen, device
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
            row_starts = torch.arange(0, batch * seqlen, seqlen, device=device, dtype=torch.int32)
            if int(cu_seqlens[-1]) != batch * seqlen or int(cu_seqlens[0]) != 0:
                raise ValueError(f"cu_seqlens must run from 0 to B*T={batch * seqlen}")
            if not torch.isin(row_starts, cu_seqlens).all():
                raise ValueError("cu_seqlens must contain every row start (multiples of T): "
                                 "documents may not cross rows of the batch")
        self.cu_seqlens = cu_seqlens

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @cached_property
    def doc_ids(self) -> torch.Tensor:
        """[B, T] int64 document index of each token (0..N-1 over the whole batch)."""
        n = self.batch * self.seqlen
        tok = torch.arange(n, device=self.device)
        if self.cu_seqlens is None:
            return (tok // self.seqlen).view(self.batch, self.seqlen)
        ids = torch.searchsorted(self.cu_seqlens[1:].long(), tok, right=True)
        return ids.view(self.batch, self.seqlen)

    @cached_property
    def pos_in_doc(self) -> torch.Tensor:
        """[B, T] int64 position of each token inside its document."""
        tok = torch.arange(self.batch * self.seqlen, device=self.device)
        if self.cu_seqlens is None:
            return (tok % self.seqlen).view(self.batch, self.seqlen)
        starts = self.cu_seqlens[:-1].long()
        return (tok - starts[self.doc_ids.flatten()]).view(self.batch, self.seqlen)

    @cached_property
    def attn_mask(self) -> torch.Tensor | None:
        """Causal block-diagonal bool mask [B, 1, T, T] (True = attend), or None if unpacked."""
        if self.cu_seqlens is None:
            return None
        d = self.doc_ids
        same = d[:, :, None] == d[:, None, :]  # [B, T, T]
        causal = torch.ones(self.seqlen, self.seqlen, dtype=torch.bool, device=self.device).tril()
        return (same & causal).unsqueeze(1)

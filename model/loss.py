"""Token cross-entropy without materialising [tokens, vocab] fp32 logits at once.

The LM head runs over chunks of tokens; each chunk's logits are recomputed in backward
(activation checkpointing), so peak extra memory is one chunk of fp32 logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_ce_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight)  # [n, vocab] for this chunk only
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, d], head_weight [V, d], labels [N] -> (loss sum fp32, target-token count)."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
    for start in range(0, h.shape[0], chunk_tokens):  # a loop over chunks, not tokens
        sl = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_ce_sum, h[sl], head_weight, labels[sl], use_reentrant=False)
        else:
            part = _chunk_ce_sum(h[sl], head_weight, labels[sl])
        total = total + part
    return total, n_tokens

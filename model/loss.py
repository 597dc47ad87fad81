"""Token cross-entropy without materialising [tokens, vocab] fp32 logits at once.

A custom autograd function runs the LM head over chunks of tokens: the forward keeps only the
loss sum; the backward recomputes each chunk's logits and forms (softmax - onehot) @ W and its
transpose directly. Peak extra memory is one chunk of fp32 logits; no autograd graph is built
over the vocabulary. Returns the loss sum so the trainer can divide by the global token count.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(h.dtype, torch.float32)
    return (h @ w.t()).to(compute)  # [n, vocab] fp32 (fp64 for fp64 inputs)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for s in range(0, h.shape[0], chunk):  # a loop over chunks of tokens, not tokens
            logits = _chunk_logits(h[s:s + chunk], w)
            y = labels[s:s + chunk]
            keep = y != IGNORE_INDEX
            picked = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)  # [n]
            total = total + ((torch.logsumexp(logits, 1) - picked) * keep).sum()
        ctx.save_for_backward(h, w, labels)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        h, w, labels = ctx.saved_tensors
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32),
                         device=w.device)
        for s in range(0, h.shape[0], ctx.chunk):
            hc, y = h[s:s + ctx.chunk], labels[s:s + ctx.chunk]
            p = torch.softmax(_chunk_logits(hc, w), dim=1)  # [n, vocab]
            keep = (y != IGNORE_INDEX).to(p.dtype)
            p[torch.arange(y.shape[0], device=y.device), y.clamp(min=0)] -= 1.0
            p = p * (keep * grad).unsqueeze(1)  # d loss_sum / d logits
            dh[s:s + ctx.chunk] = (p @ w.to(p.dtype)).to(h.dtype)
            dw += p.t() @ hc.to(p.dtype)
        return dh, dw.to(w.dtype), None, None


def chunked_cross_entropy(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, d], head_weight [V, d], labels [N] -> (loss sum fp32, target-token count)."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    return _ChunkedCrossEntropy.apply(h, head_weight, labels, chunk_tokens), n_tokens

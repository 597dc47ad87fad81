"""Token cross-entropy without materialising [tokens, vocab] fp32 logits at once.

A custom autograd function runs the LM head over chunks of tokens: the forward keeps only the
loss sum; the backward recomputes each chunk's logits and forms (softmax - onehot) @ W and its
transpose directly. Peak extra memory is one chunk of fp32 logits; no autograd graph is built
over the vocabulary. Logits and softmax are fp32; the two backward GEMMs run in the activation
dtype (bf16 on GPU) with fp32 accumulation, and the head weight is cast at most once per
backward, never per chunk. Returns the loss sum so the trainer can divide by the global token
count.
"""

from __future__ import annotations

import torch

from model.ops.backends import cuda_backends_forced

IGNORE_INDEX = -100


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in the operands' dtype with an fp32 (or wider) result.

    bf16 on CUDA (or under `force_cuda_backends()`): one bf16 GEMM that accumulates and writes
    fp32 (`torch.mm(out_dtype=)`), so no operand is upcast; elsewhere the product is cast
    (fp32/fp64 operands: exact)."""
    compute = torch.promote_types(a.dtype, torch.float32)
    if (a.is_cuda or cuda_backends_forced()) and a.dtype != compute and _HAS_MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=compute)
    return (a @ b).to(compute)


_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch >= 2.8: mm.dtype overload


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return mm_fp32_out(h, w.t())  # [n, vocab] fp32 (fp64 for fp64 inputs)


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
        w_act = w.to(h.dtype)  # the head weight in the activation dtype, cast once
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32),
                         device=w.device)
        for s in range(0, h.shape[0], ctx.chunk):
            hc, y = h[s:s + ctx.chunk], labels[s:s + ctx.chunk]
            p = torch.softmax(_chunk_logits(hc, w_act), dim=1)  # [n, vocab] fp32
            keep = (y != IGNORE_INDEX).to(p.dtype)
            p[torch.arange(y.shape[0], device=y.device), y.clamp(min=0)] -= 1.0
            # d loss_sum / d logits, in the activation dtype: both GEMMs below run there
            # (fp32 accumulation inside; dw also accumulates over chunks in fp32)
            p = (p * (keep * grad).unsqueeze(1)).to(h.dtype)
            dh[s:s + ctx.chunk] = p @ w_act
            dw += mm_fp32_out(p.t(), hc)
        return dh, dw.to(w.dtype), None, None


def chunked_cross_entropy(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, d], head_weight [V, d], labels [N] -> (loss sum fp32, target-token count)."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    return _ChunkedCrossEntropy.apply(h, head_weight, labels, chunk_tokens), n_tokens

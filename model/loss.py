"""Token cross-entropy without materialising [tokens, vocab] fp32 logits at once.

A custom autograd function runs the LM head over chunks of tokens: the forward keeps the loss
sum and each token's log-sum-exp ([N] fp32); the backward recomputes each chunk's logits and
forms (softmax - onehot) x scale in one pass (`model.ops.ce_grad`: our Triton kernel on CUDA,
reading the fp32 logits once and writing the activation dtype), then @ W and its transpose.
Peak extra memory is one chunk of fp32 logits; no autograd graph is built over the vocabulary.
Logits are fp32; the two backward GEMMs run in the activation dtype (bf16 on GPU) with fp32
accumulation, and the head weight is cast at most once per backward, never per chunk. The
head's gradient accumulates over chunks in fp32, or, with one chunk, comes straight out of its
GEMM. Returns the loss sum so the trainer can divide by the global token count.
"""

from __future__ import annotations

import torch

from model.ops.backends import cuda_backends_forced
from model.ops.ce_grad import ce_logit_grad

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
        compute = torch.promote_types(h.dtype, torch.float32)
        total = torch.zeros((), dtype=compute, device=h.device)
        lse = torch.empty(h.shape[0], dtype=compute, device=h.device)
        for s in range(0, h.shape[0], chunk):  # a loop over chunks of tokens, not tokens
            logits = _chunk_logits(h[s:s + chunk], w)
            y = labels[s:s + chunk]
            keep = y != IGNORE_INDEX
            picked = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)  # [n]
            lse[s:s + chunk] = torch.logsumexp(logits, 1)
            total = total + ((lse[s:s + chunk] - picked) * keep).sum()
        ctx.save_for_backward(h, w, labels, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        h, w, labels, lse = ctx.saved_tensors
        w_act = w.to(h.dtype)  # the head weight in the activation dtype, cast once
        dh = torch.empty_like(h)
        scale = (labels != IGNORE_INDEX).to(lse.dtype) * grad.to(lse.dtype)  # [N]
        starts = range(0, h.shape[0], ctx.chunk)
        dw = None
        for s in starts:
            e = s + ctx.chunk
            hc = h[s:e]
            # d loss_sum / d logits in the activation dtype: both GEMMs below run there
            # (fp32 accumulation inside)
            p = ce_logit_grad(_chunk_logits(hc, w_act), lse[s:e], labels[s:e], scale[s:e],
                              h.dtype)
            dh[s:e] = p @ w_act
            if len(starts) == 1 and w.dtype == h.dtype:  # one chunk: the GEMM writes the
                dw = p.t() @ hc  # gradient in w's dtype (fp32 accumulation inside)
            elif dw is None:  # several: accumulate over chunks in fp32 (or wider)
                dw = mm_fp32_out(p.t(), hc)
            else:
                dw += mm_fp32_out(p.t(), hc)
        if dw is None:  # no tokens
            dw = torch.zeros_like(w)
        return dh, dw.to(w.dtype), None, None


def chunked_cross_entropy(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, d], head_weight [V, d], labels [N] -> (loss sum fp32, target-token count)."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    return _ChunkedCrossEntropy.apply(h, head_weight, labels, chunk_tokens), n_tokens

"""Token cross-entropy without materialising [tokens, vocab] fp32 logits at once.

A custom autograd function runs the LM head over chunks of tokens; per chunk it forms the fp32
logits, each token's log-sum-exp and the loss sum, and (softmax - onehot) x keep in one pass
over the logits (`model.ops.ce_grad`: our Triton kernel on CUDA, reading the fp32 logits once
and writing the activation dtype). The loss sum is linear in what flows into it, so the input
and head gradients for an upstream gradient of 1 are formed right there in the forward, from
the logits it already has (`grads_in_forward`, the default: `model.loss_grads_in_forward`),
and the backward only scales them: the LM head's GEMMs run 3 times a step, not 4, at the cost
of keeping d hidden [N, d] and d head [V, d] in fp32 from forward to backward. With
`grads_in_forward=False` the forward keeps the inputs and the log-sum-exp and the backward
recomputes the logits. A forward that needs no gradient (evaluation) forms none.

Peak extra memory is one chunk of fp32 logits; no autograd graph is built over the vocabulary.
The two gradient GEMMs run in the activation dtype (bf16 on GPU) with fp32 accumulation and
fp32 results, and the head weight is cast at most once, never per chunk. Returns the loss sum
so the trainer can divide by the global token count.
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
_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def addmm_fp32_out_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c += a @ b in place, c fp32 (or wider): the GEMM adds into c itself (cuBLAS beta = 1),
    bf16 operands on CUDA included (`torch.addmm(out_dtype=, out=)`), so accumulating over
    chunks costs no extra pass over c; elsewhere an add of the cast product."""
    if a.dtype == c.dtype:
        return torch.addmm(c, a, b, out=c)
    if (a.is_cuda or cuda_backends_forced()) and _HAS_ADDMM_OUT_DTYPE:
        return torch.addmm(c, a, b, out_dtype=c.dtype, out=c)
    return c.add_(mm_fp32_out(a, b))


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return mm_fp32_out(h, w.t())  # [n, vocab] fp32 (fp64 for fp64 inputs)


def _scaled(t: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t x grad written in `dtype` (one kernel)."""
    return torch.mul(t, grad.to(t.dtype), out=torch.empty(t.shape, dtype=dtype, device=t.device))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                chunk: int, grads_in_forward: bool) -> torch.Tensor:
        compute = torch.promote_types(h.dtype, torch.float32)
        total = torch.zeros((), dtype=compute, device=h.device)
        lse = torch.empty(h.shape[0], dtype=compute, device=h.device)
        keep = (labels != IGNORE_INDEX).to(compute)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        early = grads_in_forward and (need_h or need_w)
        w_act = w.to(h.dtype) if early else None  # in the activation dtype, cast once
        dh = torch.empty(h.shape, dtype=compute, device=h.device) if early and need_h else None
        dw = None
        for s in range(0, h.shape[0], chunk):  # a loop over chunks of tokens, not tokens
            e = s + chunk
            logits = _chunk_logits(h[s:e], w)
            y = labels[s:e]
            picked = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)  # [n]
            lse[s:e] = torch.logsumexp(logits, 1)
            total = total + ((lse[s:e] - picked) * keep[s:e]).sum()
            if early:
                p = ce_logit_grad(logits, lse[s:e], y, keep[s:e], h.dtype)
                del logits
                if dh is not None:
                    dh[s:e] = mm_fp32_out(p, w_act)
                if need_w:  # accumulated over chunks in fp32 inside the GEMM
                    dw = (mm_fp32_out(p.t(), h[s:e]) if dw is None
                          else addmm_fp32_out_(dw, p.t(), h[s:e]))
        ctx.chunk, ctx.early = chunk, early
        ctx.dtypes = (h.dtype, w.dtype)
        if early:
            if need_w and dw is None:  # no tokens
                dw = torch.zeros(w.shape, dtype=compute, device=w.device)
            ctx.save_for_backward(dh, dw)
        else:
            ctx.save_for_backward(h, w, labels, lse)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        h_dtype, w_dtype = ctx.dtypes
        if ctx.early:  # d loss_sum / d (h, w) at an upstream gradient of 1: scale them
            dh1, dw1 = ctx.saved_tensors
            dh = _scaled(dh1, grad, h_dtype) if dh1 is not None else None
            dw = _scaled(dw1, grad, w_dtype) if dw1 is not None else None
            return dh, dw, None, None, None
        h, w, labels, lse = ctx.saved_tensors
        w_act = w.to(h.dtype)
        dh = torch.empty_like(h)
        scale = (labels != IGNORE_INDEX).to(lse.dtype) * grad.to(lse.dtype)  # [N]
        starts = range(0, h.shape[0], ctx.chunk)
        dw = None
        for s in starts:
            e = s + ctx.chunk
            hc = h[s:e]
            p = ce_logit_grad(_chunk_logits(hc, w_act), lse[s:e], labels[s:e], scale[s:e],
                              h.dtype)
            dh[s:e] = p @ w_act
            if len(starts) == 1 and w.dtype == h.dtype:  # one chunk: the GEMM writes the
                dw = p.t() @ hc  # gradient in w's dtype (fp32 accumulation inside)
            elif dw is None:  # several: accumulate over chunks in fp32 (or wider)
                dw = mm_fp32_out(p.t(), hc)
            else:
                addmm_fp32_out_(dw, p.t(), hc)
        if dw is None:  # no tokens
            dw = torch.zeros_like(w)
        return dh, dw.to(w.dtype), None, None, None


def chunked_cross_entropy(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int = 4096, grads_in_forward: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, d], head_weight [V, d], labels [N] -> (loss sum fp32, target-token count)."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    early = grads_in_forward and torch.is_grad_enabled()  # (the forward itself runs without)
    return _ChunkedCrossEntropy.apply(h, head_weight, labels, chunk_tokens, early), n_tokens

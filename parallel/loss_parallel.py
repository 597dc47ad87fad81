"""Vocabulary-parallel cross-entropy: the LM head sharded by vocabulary rows over tp.

Each tp rank holds V/tp rows of the head and computes its slice of every token's logits, in
chunks of tokens as `model.loss.chunked_cross_entropy` does; the log-sum-exp and the target
logit are completed with three all-reduces per chunk (max, sum of exponentials, picked logit).
Backward recomputes the chunk's local logits: d hidden is this rank's partial sum (reduced by
the sequence-parallel all-gather's backward), d head is exact for the local rows. The hidden
states arrive as sequence slices; they and the labels are gathered over tp first (token order
does not matter to a per-token loss). Every tp rank returns the same, full loss sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.loss import IGNORE_INDEX, mm_fp32_out
from parallel.collectives import all_gather


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                chunk: int, group, vocab_start: int) -> torch.Tensor:
        compute = torch.promote_types(h.dtype, torch.float32)
        v_local = w.shape[0]
        total = torch.zeros((), dtype=compute, device=h.device)
        stats = []
        for s in range(0, h.shape[0], chunk):  # a loop over chunks of tokens, not tokens
            logits = mm_fp32_out(h[s:s + chunk], w.t())  # [n, V/tp]
            y = labels[s:s + chunk]
            local = y - vocab_start
            mine = (local >= 0) & (local < v_local)
            m = logits.max(1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sumexp = torch.exp(logits - m[:, None]).sum(1)
            picked = logits.gather(1, local.clamp(0, v_local - 1)[:, None])[:, 0] * mine
            both = torch.stack([sumexp, picked])
            dist.all_reduce(both, group=group)
            keep = y != IGNORE_INDEX
            total = total + ((torch.log(both[0]) + m - both[1]) * keep).sum()
            stats.append(torch.stack([m, both[0]]))
        ctx.save_for_backward(h, w, labels, torch.cat(stats, dim=1) if stats else h.new_zeros(2, 0))
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        h, w, labels, stats = ctx.saved_tensors
        compute = stats.dtype
        v_local = w.shape[0]
        w_act = w.to(h.dtype)  # cast at most once per backward
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=compute, device=w.device)
        for s in range(0, h.shape[0], ctx.chunk):
            hc, y = h[s:s + ctx.chunk], labels[s:s + ctx.chunk]
            m, sumexp = stats[0, s:s + ctx.chunk], stats[1, s:s + ctx.chunk]
            p = torch.exp(mm_fp32_out(hc, w_act.t()) - m[:, None]) / sumexp[:, None]  # [n, V/tp]
            local = y - ctx.vocab_start
            mine = ((local >= 0) & (local < v_local)).to(p.dtype)
            # minus one at the target column where this rank holds it (a scatter, no mask index)
            p.scatter_add_(1, local.clamp(0, v_local - 1)[:, None], -mine[:, None])
            p = (p * ((y != IGNORE_INDEX).to(compute) * grad).unsqueeze(1)).to(h.dtype)
            dh[s:s + ctx.chunk] = p @ w_act  # activation-dtype GEMMs, fp32 accumulation
            dw += mm_fp32_out(p.t(), hc)
        return dh, dw.to(w.dtype), None, None, None, None


def vocab_parallel_cross_entropy(h: torch.Tensor, head_weight: torch.Tensor,
                                 labels: torch.Tensor, chunk_tokens: int, *, group,
                                 vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N/tp, d] this rank's tokens, head_weight [V/tp, d] this rank's vocabulary rows,
    labels [N/tp] -> (full loss sum, full target-token count), equal on every tp rank."""
    h_all = all_gather(h.contiguous(), 0, group)  # backward: reduce-scatter of partial sums
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, labels.contiguous(), group=group)
    y = torch.cat(parts)
    loss = _VocabParallelCE.apply(h_all, head_weight, y, chunk_tokens, group, vocab_start)
    return loss, (y != IGNORE_INDEX).sum()

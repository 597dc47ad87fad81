"""Block Attention-Residual mixing op (k3-architecture.md §3.3).

Softmax attention over depth: each source is a hidden state; its key is the source RMS-normalised
with the mix's norm weight; the query is the mix's pseudo-query (`proj.weight[0]`). The raw
(un-normalised) sources are mixed. All maths in fp32 (float64 stays float64); the result in the
sources' dtype. This op holds no parameters; `model.attnres` passes them in.

* `attnres_mix(blocks, prefix, norm_weight, query, eps)`: the op the model calls. Sources are
  the snapshot stack `blocks` [n, ..., d] followed by the running `prefix` [..., d], read in
  place (never concatenated). Custom ops `k3::attnres_mix` / `k3::attnres_mix_bwd` (one node
  each in fake-tensor traces and under torch.compile): the forward reads the stack once for the
  statistics and once for the weighted sum and keeps only rstd and the logits ([N, ...] fp32);
  the backward reads it twice (the logit gradients, then the source gradients, with the
  pseudo-query gradient accumulated on the way). Backends: our Triton kernels
  (`model.ops.attnres_triton`; CUDA, 16/32-bit) or the PyTorch passes below (CPU, float64);
  `K3_ATTNRES_BACKEND=auto|torch|triton` overrides. fla's `fused_attnres` computes the same
  function, but it is one autograd.Function whose forward and backward cannot be called apart
  (inside a custom op its backward would have to re-run the forward), its 0.5 and 0.6 releases
  take the sources differently (one stacked tensor / a list), and it cannot run in CI; ours
  runs under TRITON_INTERPRET=1 there, against the reference.
* `attnres_mix_reference(sources, query, eps)`: the formula in autograd-differentiated PyTorch
  over `sources` [N, ..., d] and the folded query (norm weight * pseudo-query): the oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.ops.backends import compute_dtype, triton_chosen

_ENV = "K3_ATTNRES_BACKEND"


def attnres_mix_reference(sources: Tensor, query: Tensor, eps: float = 1e-5) -> Tensor:
    """Mix `sources` [N, ..., d] (snapshots first, running prefix last) with `query` [d].

    Returns [..., d]: sum_n softmax_n(<rmsnorm(sources_n), query>) * sources_n.
    """
    compute = torch.promote_types(sources.dtype, torch.float32)
    v = sources.to(compute)  # [N, ..., d]
    khat = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # [N, ..., d]
    logits = (khat * query.to(compute)).sum(-1)  # [N, ...]
    p = torch.softmax(logits, dim=0)  # [N, ...]
    out = (p.unsqueeze(-1) * v).sum(0)  # [..., d]
    return out.to(sources.dtype)


def attnres_weights(sources: Tensor, query: Tensor, eps: float = 1e-5) -> Tensor:
    """The depth-softmax weights [N, ...] of the mix (for metrics and heatmaps)."""
    compute = torch.promote_types(sources.dtype, torch.float32)
    v = sources.to(compute)
    khat = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return torch.softmax((khat * query.to(compute)).sum(-1), dim=0)


def attnres_mix(blocks: Tensor, prefix: Tensor, norm_weight: Tensor, query: Tensor,
                eps: float = 1e-5) -> Tensor:
    """blocks [n, ..., d], prefix [..., d], norm_weight and query [d] -> mixed [..., d]."""
    if blocks.shape[1:] != prefix.shape or blocks.dtype != prefix.dtype:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} must stack prefixes "
                         f"{tuple(prefix.shape)} {prefix.dtype}")
    d = prefix.shape[-1]
    if norm_weight.shape != (d,) or query.shape != (d,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} and query "
                         f"{tuple(query.shape)} must be [{d}]")
    return _mix_op(blocks.contiguous(), prefix.contiguous(), norm_weight, query, eps)[0]


# ----------------------------------------------------------------------------- PyTorch passes
def _flat(blocks: Tensor, prefix: Tensor, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    d = prefix.shape[-1]
    M = prefix.numel() // d
    return blocks.reshape(blocks.shape[0], M, d).to(compute), prefix.reshape(M, d).to(compute)


def _mix_fwd_torch(blocks: Tensor, prefix: Tensor, wq: Tensor, eps: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(out [M, d] compute dtype, rstd [N, M], logits [N, M])."""
    b, x = _flat(blocks, prefix, wq.dtype)
    d = x.shape[-1]
    ss = torch.cat([torch.linalg.vector_norm(b, dim=-1), torch.linalg.vector_norm(x, dim=-1)[None]])
    rstd = torch.rsqrt(ss.square_().div_(d).add_(eps))  # [N, M]
    logits = torch.cat([torch.matmul(b, wq), torch.mv(x, wq)[None]]).mul_(rstd)
    p = torch.softmax(logits, dim=0)
    out = x * p[-1, :, None]
    for i in range(b.shape[0]):  # over the <= 9 sources, not tokens
        out.addcmul_(b[i], p[i, :, None])
    return out, rstd, logits


def _mix_bwd_torch(dout: Tensor, blocks: Tensor, prefix: Tensor, wq: Tensor, rstd: Tensor,
                   logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dblocks [n, M, d], dprefix [M, d], d wq [d]) in the compute dtype."""
    b, x = _flat(blocks, prefix, wq.dtype)
    n, d = b.shape[0], x.shape[-1]
    g = dout.reshape(x.shape).to(wq.dtype)
    p = torch.softmax(logits, dim=0)
    dp = torch.cat([(b * g).sum(-1), (x * g).sum(-1)[None]])  # d out / d p [N, M]
    dl = p * (dp - (p * dp).sum(0, keepdim=True))  # d logits
    c = dl * rstd  # coefficient of wq in d source
    a = c * logits * rstd / -d  # coefficient of the source itself (through rstd)
    dwq = torch.mv(b.reshape(n * x.shape[0], d).t(), c[:n].reshape(-1)) + torch.mv(x.t(), c[n])
    db = b * a[:n, :, None]
    db.addcmul_(p[:n, :, None], g).addcmul_(c[:n, :, None], wq)
    dx = x * a[n, :, None]
    dx.addcmul_(p[n, :, None], g).addcmul_(c[n, :, None], wq)
    return db, dx, dwq


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("k3::attnres_mix", mutates_args=())
def _mix_op(blocks: Tensor, prefix: Tensor, norm_weight: Tensor, query: Tensor, eps: float
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(mixed [..., d] in prefix's dtype, rstd [N, ...] and logits [N, ...] in fp32 or fp64)."""
    compute = compute_dtype(prefix)
    wq = norm_weight.to(compute) * query.to(compute)
    if triton_chosen(prefix, _ENV):
        from model.ops import attnres_triton

        out, rstd, logits = attnres_triton.mix_fwd(blocks, prefix, wq, eps)
    else:
        out, rstd, logits = _mix_fwd_torch(blocks, prefix, wq, eps)
    stats = (blocks.shape[0] + 1, *prefix.shape[:-1])
    return out.reshape(prefix.shape).to(prefix.dtype), rstd.view(stats), logits.view(stats)


@_mix_op.register_fake
def _(blocks, prefix, norm_weight, query, eps):
    stats = (blocks.shape[0] + 1, *prefix.shape[:-1])
    compute = compute_dtype(prefix)
    return (prefix.new_empty(prefix.shape), prefix.new_empty(stats, dtype=compute),
            prefix.new_empty(stats, dtype=compute))


@torch.library.custom_op("k3::attnres_mix_bwd", mutates_args=())
def _mix_bwd_op(dout: Tensor, blocks: Tensor, prefix: Tensor, norm_weight: Tensor,
                query: Tensor, rstd: Tensor, logits: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (d blocks, d prefix, d norm_weight, d query) of k3::attnres_mix."""
    compute = compute_dtype(prefix)
    nw, q = norm_weight.to(compute), query.to(compute)
    wq = nw * q
    N = blocks.shape[0] + 1
    r, lg = rstd.reshape(N, -1), logits.reshape(N, -1)
    if triton_chosen(prefix, _ENV):
        from model.ops import attnres_triton

        db, dx, dwq = attnres_triton.mix_bwd(dout.contiguous(), blocks, prefix, wq, r, lg)
    else:
        db, dx, dwq = _mix_bwd_torch(dout, blocks, prefix, wq, r, lg)
    return (db.reshape(blocks.shape).to(blocks.dtype), dx.reshape(prefix.shape).to(prefix.dtype),
            (dwq * q).to(norm_weight.dtype), (dwq * nw).to(query.dtype))


@_mix_bwd_op.register_fake
def _(dout, blocks, prefix, norm_weight, query, rstd, logits):
    return (torch.empty_like(blocks), torch.empty_like(prefix), torch.empty_like(norm_weight),
            torch.empty_like(query))


def _setup(ctx, inputs, output) -> None:
    blocks, prefix, norm_weight, query, _eps = inputs
    _out, rstd, logits = output
    ctx.save_for_backward(blocks, prefix, norm_weight, query, rstd, logits)
    ctx.mark_non_differentiable(rstd, logits)


def _backward(ctx, dout: Tensor, _drstd: Tensor | None, _dlogits: Tensor | None):
    blocks, prefix, norm_weight, query, rstd, logits = ctx.saved_tensors
    db, dx, dnw, dq = _mix_bwd_op(dout, blocks, prefix, norm_weight, query, rstd, logits)
    return db, dx, dnw, dq, None


_mix_op.register_autograd(_backward, setup_context=_setup)

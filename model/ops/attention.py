"""Causal softmax attention over packed documents (Gated MLA's core), with no O(T^2) tensor.

`packed_causal_attention(q, k, v, packing, scale)`: q, k [B, T, H, Dqk], v [B, T, H, Dv] ->
o [B, T, H, Dv] in q's dtype. Each token attends causally to the tokens of its own document
(`Packing.cu_seqlens`); unpacked rows (`packing=None` or no `cu_seqlens`) take SDPA with
`is_causal=True`. No backend reads tensor data on the host: the only sizes used are shapes and
`Packing.max_seqlen`, a host int.

Backends for packed rows (`attention_backend`):
- "varlen" (CUDA fp16/bf16; the choice under `model.ops.backends.force_cuda_backends()`): the
  custom op `k3::varlen_attention` over `torch.nn.attention.varlen.varlen_attn` (FlashAttention
  on the flattened [B*T, H, D] tokens, `cu_seqlens` for queries and keys), and its backward
  `k3::varlen_attention_backward` over torch's registered `torch_attn::_varlen_attn_backward`.
  The kernel needs equal head dims, so v is zero-padded to Dqk and the output sliced (the padded
  output channels are exactly zero). Both ops are registered at import on every machine, with
  fake implementations, so fake-tensor traces and torch.compile see two opaque nodes.
- "blockwise" (any device and dtype; the reference path): a static loop over query blocks of
  `BLOCK_Q` tokens, each attending to the keys [0, block end) through SDPA with a
  [B, 1, BLOCK_Q, block end] same-document-and-causal bool mask built from `Packing.doc_ids`.
  Computed in fp32 (float64 stays float64); v is zero-padded to Dqk so CPU's fused SDPA kernel
  applies, which saves only the output and log-sum-exp for backward, not the probabilities.
  Largest tensor: B * BLOCK_Q * T elements (the mask) or B * H * T * Dqk (q, k, v themselves).

`K3_ATTN_BACKEND=auto|varlen|blockwise` overrides the choice. Not done here: dropout, sliding
windows, GQA, attention sinks, context parallelism, a KV cache.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.ops.backends import compile_constant, cuda_backends_forced
from model.packing import Packing

Tensor = torch.Tensor

__all__ = ["BLOCK_Q", "attention_backend", "blockwise_attention", "packed_causal_attention",
           "varlen_attention"]

BLOCK_Q = 256  # query tokens per block of the blockwise path
BACKENDS = ("varlen", "blockwise")


# ----------------------------------------------------------------------------- backend dispatch
def attention_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """Backend for packed rows on `device`/`dtype`: "varlen" or "blockwise".

    `K3_ATTN_BACKEND`: "auto" (default: varlen on CUDA for fp16/bf16 when torch has
    `varlen_attn`, or whenever CUDA backends are forced), "varlen" or "blockwise". Under
    torch.compile the choice is made once, when the layer is traced (`_attention_choice`).
    """
    return _attention_choice(torch.device(device).type, dtype, cuda_backends_forced())


@compile_constant
def _attention_choice(device_type: str, dtype: torch.dtype, forced: bool) -> str:
    """`attention_backend` from constants. torch.compile calls it while tracing and keeps the
    answer (no guard on the environment; `forced`, device and dtype are guarded by the caller's
    inputs), so the environment read and the import check stay out of the graph."""
    mode = os.environ.get("K3_ATTN_BACKEND", "auto").strip().lower() or "auto"
    if mode in BACKENDS:
        return mode
    if mode != "auto":
        raise ValueError(f"K3_ATTN_BACKEND must be 'auto', 'varlen' or 'blockwise', got {mode!r}")
    if forced:
        return "varlen"
    usable = (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)
              and _varlen_forward_fn() is not None)
    return "varlen" if usable else "blockwise"


def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, packing: Packing | None,
                            scale: float, logit_bound: bool = False
                            ) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention within each document: [B, T, H, Dqk] x2, [B, T, H, Dv] -> [B, T, H, Dv].

    ``logit_bound``: also return, per head, the largest log-sum-exp of any query's scaled
    logits ([H] fp32, no gradient): an upper bound on the head's largest pre-softmax logit,
    within log(document length) of it (QK-Clip's S_max). The varlen kernel returns it with the
    output; the reference paths compute it blockwise (a second Q K^T, no gradient)."""
    B, T, H, D = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError(f"q, k [B, T, H, Dqk] and v [B, T, H, Dv] must agree, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if packing is None or not packing.packed:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, *]
            is_causal=True, scale=scale,
        ).transpose(1, 2)  # [B, T, H, Dv]
        return (o, _lse_bound(q, k, None, scale)) if logit_bound else o
    if (packing.batch, packing.seqlen) != (B, T):
        raise ValueError(f"packing is for a [{packing.batch}, {packing.seqlen}] batch, "
                         f"q is [{B}, {T}, ...]")
    if attention_backend(q.device, q.dtype) == "varlen":
        if v.shape[-1] > D:
            raise ValueError(f"varlen attention pads v to the q/k head dim: needs Dv <= Dqk, got "
                             f"Dv={v.shape[-1]} > Dqk={D}; set K3_ATTN_BACKEND=blockwise")
        flat = (B * T, H)
        o, lse = varlen_attention(q.reshape(*flat, D), k.reshape(*flat, D),
                                  v.reshape(*flat, v.shape[-1]), packing.cu_seqlens,
                                  packing.max_seqlen, float(scale))
        o = o.view(B, T, H, v.shape[-1])
        return (o, lse.detach().amax(dim=1).float()) if logit_bound else o  # lse [H, N]
    o = blockwise_attention(q, k, v, packing, scale)
    return (o, _lse_bound(q, k, packing.doc_ids, scale)) if logit_bound else o


@torch.no_grad()
def _lse_bound(q: Tensor, k: Tensor, doc_ids: Tensor | None, scale: float,
               block_q: int = BLOCK_Q) -> Tensor:
    """Per head, the largest log-sum-exp over a query's causal same-document keys ([H] fp32):
    the reference paths' QK-Clip bound, blockwise like `blockwise_attention`."""
    B, T, H, D = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    qh = q.detach().to(compute).transpose(1, 2)  # [B, H, T, D]
    kh = k.detach().to(compute).transpose(1, 2)
    pos = torch.arange(T, device=q.device)
    best = torch.full((H,), float("-inf"), dtype=compute, device=q.device)
    for s in range(0, T, block_q):  # static: T is a shape
        e = min(s + block_q, T)
        keep = (pos[s:e, None] >= pos[None, :e]).expand(B, e - s, e)  # [B, Bq, e]
        if doc_ids is not None:
            keep = keep & (doc_ids[:, s:e, None] == doc_ids[:, None, :e])
        scores = (qh[:, :, s:e] @ kh[:, :, :e].mT) * scale  # [B, H, Bq, e]
        scores = scores.masked_fill(~keep.unsqueeze(1), float("-inf"))
        best = torch.maximum(best, torch.logsumexp(scores, dim=-1).amax(dim=(0, 2)))
    return best.float()


# ----------------------------------------------------------------------------- blockwise
def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, packing: Packing, scale: float,
                        block_q: int = BLOCK_Q) -> Tensor:
    """Reference path: a static loop over query blocks, masked SDPA against keys [0, end)."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    compute = torch.promote_types(q.dtype, torch.float32)
    qh = q.to(compute).transpose(1, 2)  # [B, H, T, D]
    kh = k.to(compute).transpose(1, 2)  # [B, H, T, D]
    vh = F.pad(v.to(compute), (0, max(D - Dv, 0))).transpose(1, 2)  # [B, H, T, D]: 0 past Dv
    doc = packing.doc_ids  # [B, T]
    pos = torch.arange(T, device=q.device)  # [T]
    outs = []
    for s in range(0, T, block_q):  # static: T is a shape
        e = min(s + block_q, T)
        same = doc[:, s:e, None] == doc[:, None, :e]  # [B, Bq, e]
        causal = pos[s:e, None] >= pos[None, :e]  # [Bq, e]
        mask = (same & causal).unsqueeze(1)  # [B, 1, Bq, e]; every row keeps its diagonal
        outs.append(F.scaled_dot_product_attention(
            qh[:, :, s:e], kh[:, :, :e], vh[:, :, :e], attn_mask=mask, scale=scale))
    o = torch.cat(outs, dim=2)[..., :Dv]  # [B, H, T, Dv]
    return o.transpose(1, 2).to(q.dtype)  # [B, T, H, Dv]


# ----------------------------------------------------------------------------- varlen (CUDA)
@functools.cache
def _varlen_module():
    """torch.nn.attention.varlen, or None on a torch without it (importing it registers
    torch's `torch_attn::_varlen_attn*` ops)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return varlen


def _varlen_forward_fn() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The forward kernel `k3::varlen_attention` calls (tests replace it)."""
    mod = _varlen_module()
    return None if mod is None else mod.varlen_attn


def _varlen_backward_op():
    """The backward kernel `k3::varlen_attention_backward` calls: an op whose schema names
    torch's `_varlen_attn_backward` arguments (tests replace it)."""
    mod = _varlen_module()
    if mod is None or not hasattr(torch.ops.torch_attn, "_varlen_attn_backward"):
        return None
    return torch.ops.torch_attn._varlen_attn_backward


@dataclass(frozen=True)
class _CallForm:
    """How this torch's `varlen_attn` spells causal masking and the softmax scale.

    torch 2.10 takes `is_causal=` (its first release also lacks `scale=`); pytorch#172245
    (merged 2026-01-21, before the 2.11 branch cut) replaced it with `window_size=(-1, 0)`, which
    2.11-2.13 take. The backward op keeps `is_causal` and gained `scale`, `window_size`."""
    window_size: bool  # causal as window_size=(-1, 0), else is_causal=True
    scale: bool  # takes `scale=`; without it the kernel uses D^-1/2 and we pre-scale q


@functools.cache
def _call_form(fn: Callable) -> _CallForm:
    params = inspect.signature(fn).parameters
    if "window_size" not in params and "is_causal" not in params:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn takes neither window_size nor "
                           "is_causal; set K3_ATTN_BACKEND=blockwise")
    return _CallForm(window_size="window_size" in params, scale="scale" in params)


def _pad_to(x: Tensor, d: int) -> Tensor:
    """Zero-pad the last dim to `d` (contiguous result, as the kernel wants)."""
    return F.pad(x, (0, d - x.shape[-1])) if x.shape[-1] < d else x.contiguous()


def _q_factor(form: _CallForm, scale: float, d: int) -> float:
    """Factor folded into q when the kernel cannot take `scale` (it then uses d^-1/2)."""
    return 1.0 if form.scale else scale * math.sqrt(d)


@torch.library.custom_op("k3::varlen_attention", mutates_args=())
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                     scale: float) -> tuple[Tensor, Tensor]:
    """Causal varlen attention on flattened tokens: q, k [N, H, Dqk], v [N, H, Dv], int32
    cu_seqlens [docs+1] -> (o [N, H, Dv], lse [H, N] fp32, opaque: for the backward)."""
    fn = _varlen_forward_fn()
    if fn is None:
        raise RuntimeError("k3::varlen_attention needs torch.nn.attention.varlen (torch >= 2.10)")
    D, Dv = q.shape[-1], v.shape[-1]
    form = _call_form(fn)
    kwargs = {"window_size": (-1, 0)} if form.window_size else {"is_causal": True}
    if form.scale:
        kwargs["scale"] = scale
    qk = q.contiguous() if form.scale else q * _q_factor(form, scale, D)
    out, lse = fn(qk, k.contiguous(), _pad_to(v, D), cu_seqlens, cu_seqlens, max_seqlen,
                  max_seqlen, return_aux=_varlen_module().AuxRequest(lse=True), **kwargs)
    return out[..., :Dv].contiguous(), lse  # [N, H, Dv]; padded channels are zeros


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    N, H, _ = q.shape
    return q.new_empty(N, H, v.shape[-1]), q.new_empty(H, N, dtype=torch.float32)


@torch.library.custom_op("k3::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                              lse: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `k3::varlen_attention` from FlashAttention's backward kernel."""
    op, fn = _varlen_backward_op(), _varlen_forward_fn()
    if op is None or fn is None:
        raise RuntimeError("k3::varlen_attention_backward needs torch_attn::_varlen_attn_backward"
                           " (torch >= 2.10)")
    D, Dv = q.shape[-1], v.shape[-1]
    form = _call_form(fn)
    factor = _q_factor(form, scale, D)
    known = {
        "grad_out": _pad_to(grad_o, D), "query": q.contiguous() if factor == 1.0 else q * factor,
        "key": k.contiguous(), "value": _pad_to(v, D), "out": _pad_to(o, D), "lse": lse,
        "cu_seq_q": cu_seqlens, "cu_seq_k": cu_seqlens, "max_q": max_seqlen,
        "max_k": max_seqlen, "is_causal": True,
        "rng_state": torch.zeros(2, dtype=torch.uint64, device=q.device),  # no dropout
        "scale": scale if form.scale else None,
        "window_size": [-1, 0] if form.window_size else None,
    }
    kwargs = {}
    for arg in op.default._schema.arguments:  # named as torch's varlen backward names them
        if arg.name in known and known[arg.name] is not None:
            kwargs[arg.name] = known[arg.name]
        elif not arg.has_default_value():
            raise RuntimeError(f"torch_attn::_varlen_attn_backward wants {arg.name!r}, unknown "
                               "to k3::varlen_attention_backward; set K3_ATTN_BACKEND=blockwise")
    dq, dk, dv = op(**kwargs)
    dq = dq if factor == 1.0 else dq * factor
    return dq, dk, dv[..., :Dv].contiguous()


@varlen_attention_backward.register_fake
def _(grad_o, q, k, v, o, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _backward(ctx, grad_o: Tensor | None, _grad_lse: Tensor | None):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = varlen_attention_backward(grad_o, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen,
                                           ctx.scale)
    return dq, dk, dv, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)

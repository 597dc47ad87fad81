"""Kimi Delta Attention (KDA) operator: public op, backend dispatch and PyTorch references.

What it is for (design doc §1.1, §1.5-1.7):
* ``chunk_kda(..., gate=KDAGate)``: the op the layer calls, from raw projections (q/k before
  their L2 norm, the gate pre-activation, beta's logits). On CUDA with ``fla`` importable (or
  whenever ``model.ops.backends.force_cuda_backends()`` is active) it runs fla's ``chunk_kda``
  with the prologue inside fla (q/k L2 norm, gate activation fused with the chunk cumsum,
  beta's sigmoid; ``safe_gate`` + ``lower_bound`` for K3's bounded gate) through the
  ``torch.library`` custom ops ``k3::chunk_kda_fla`` / ``k3::chunk_kda_fla_bwd``: one opaque
  node each in fake-tensor traces and torch.compile. An fla too old for that (< 0.5.2) gets the
  prologue from ``kda_prologue`` inside the op. Everywhere else (CPU CI, no Triton, or
  ``K3_KDA_BACKEND=torch``) it runs ``kda_prologue`` then ``chunk_kda_reference``.
* ``chunk_kda`` without ``gate``: the same dispatch for activated inputs (fla's plain
  semantics).
* ``chunk_kda_reference``: the chunkwise WY/UT-transform algorithm in pure PyTorch (float32, or
  float64 for float64 inputs): the layout to chunks here, the chunk math in
  ``model.ops.kda_chunk.chunk_core`` (the custom op ``k3::kda_chunk`` with a hand-written
  backward), with Python loops over chunks and the log2(chunk) levels of its intra-chunk
  blocks only (static counts, never over tokens).
* ``recurrent_kda``: the token-by-token recurrence; the test oracle and a simple decode path.

Semantics (per head, state layout [K, V]): S' = Diag(exp(g_t)) S; u = beta_t (v_t - S'^T k_t);
S = S' + k_t u^T; o_t = scale * S^T q_t. Inputs: q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K] log-decay (<= 0, already activated); beta [B, T, H] (already in (0, 1)).
Varlen: ``cu_seqlens`` [N+1] (FlashAttention convention, B == 1) packs N independent sequences along
T; states are then per sequence, [N, H, K, V]. Sequences may be empty, also at the end
(``cu_seqlens`` padded with repeats of T); an empty sequence's final state is its initial state
(zeros without one). ``cu_seqlens`` is not validated here (that would read it on the host): the
caller checks its host copy (``model.packing.check_cu_seqlens``).

No host synchronisation: nothing here reads tensor data on the host or makes a shape depend on
it (the reference traces under ``FakeTensorMode``). Varlen uses a document-aligned chunk layout:
every document starts a fresh chunk, the chunks of all documents follow one another in one row
of a static number of chunks, floor((T + min(N, T) (C - 1)) / C) >= sum_i ceil(len_i / C), and
the inter-chunk state is reset (multiplied by 0, plus the document's initial state) at chunks
where a document starts. The intra-chunk scores are exact for any decay strength (see
``model.ops.kda_chunk.intra_scores``), with no data-dependent choice of formula.

What it deliberately does NOT do: GVA (H_v != H), the V-first state layout, fla's
``allow_neg_eigval``, context parallelism (``model.ops.kda_context`` builds it on this op), or
double backward through the reference. The reference (and ``kda_prologue``) is not a fast
kernel.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model.ops.backends import compile_constant, cuda_backends_forced
from model.ops.kda_chunk import chunk_core
from model.ops.rms_norm import l2_norm

Tensor = torch.Tensor
KDAOut = tuple[Tensor, Tensor | None]

__all__ = ["KDAGate", "chunk_kda", "chunk_kda_reference", "kda_backend", "kda_gate",
           "kda_prologue", "recurrent_kda"]


# ----------------------------------------------------------------------------- backend dispatch
@functools.cache
def _load_fla() -> Callable[..., KDAOut] | None:
    """Import fla's chunk_kda once; None if fla (or Triton under it) cannot be imported."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception:  # ImportError, or Triton/CUDA errors raised while fla imports
        return None
    return fla_chunk_kda


def _fla_version() -> tuple[int, ...]:
    """Installed fla version as a tuple of ints ((0,) if unknown)."""
    try:
        import fla

        return tuple(int(p) for p in str(fla.__version__).split(".")[:3] if p.isdigit())
    except Exception:
        return (0,)


# fla's chunk_kda (fla/ops/kda/chunk.py; fla-core / flash-linear-attention on PyPI):
#   0.4.0            (q, k, v, g, beta, scale, initial_state, output_final_state,
#                     use_qk_l2norm_in_kernel, cu_seqlens, **kwargs); chunk size fixed at 64
#   0.4.1            adds use_gate_in_kernel, chunk_indices
#   0.4.2, 0.5.0     add cu_seqlens_cpu (host copy: chunk indices without a device read)
#   0.5.1, 0.5.2     chunk_size read from **kwargs (kwargs.pop("chunk_size", 64), only 32 or 64);
#                    0.5.2 adds use_beta_sigmoid_in_kernel (with safe_gate, lower_bound, A_log
#                    and dt_bias in **kwargs: the whole prologue in fla, `_FLA_GATE_ARGS`)
#   0.6.0            same, plus use_graph / max_num_seqs (fixed-shape on-device chunk list)
# cu_seqlens: [N+1] integer (we pass int32), B == 1; initial_state must be float32.
# inspect.signature shows cu_seqlens_cpu as a named parameter; chunk_size hides in **kwargs, so it
# needs the version (before 0.5.1 **kwargs swallowed it silently and the kernels used 64).
_FLA_CHUNK_SIZES = (32, 64)

# What fla needs to run the q/k L2 norm, the gate activation (+ chunk cumsum) and beta's sigmoid
# itself (fla-core >= 0.5.2; A_log and dt_bias go through **kwargs). safe_gate (the M=16
# tensor-core intra-chunk path) takes lower bounds in [-5, 0) only.
_FLA_GATE_ARGS = frozenset({"use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                            "use_beta_sigmoid_in_kernel", "safe_gate", "lower_bound"})


@functools.cache
def _fla_accepts(fla_fn: Callable[..., object]) -> frozenset[str]:
    """Which of the optional arguments fla_fn takes: "chunk_size", "cu_seqlens_cpu" and the
    in-kernel prologue's flags (``_FLA_GATE_ARGS``)."""
    params = inspect.signature(fla_fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = {n for n in ("chunk_size", "cu_seqlens_cpu", *_FLA_GATE_ARGS) if n in params}
    if "chunk_size" not in names and var_kw and _fla_version() >= (0, 5, 1):
        names.add("chunk_size")
    return frozenset(names)


def kda_backend(device: torch.device | str) -> str:
    """Backend chunk_kda uses for tensors on ``device``: "fla" or "torch".

    Inside ``force_cuda_backends()``: "fla", with no import or device check (fake-tensor traces
    of the CUDA op graph). ``K3_KDA_BACKEND``: "auto" (default: fla on CUDA when importable),
    "torch" (always the reference) or "fla" (require fla; raises if unusable on ``device``).
    Under torch.compile the choice is made once, when the layer is traced (``_kda_choice``).
    """
    if cuda_backends_forced():
        return "fla"
    return _kda_choice(torch.device(device))


@compile_constant
def _kda_choice(device: torch.device) -> str:
    """``kda_backend`` without forcing, from a constant device. torch.compile calls it while
    tracing and keeps the answer (the device is guarded by the caller's inputs; the environment
    is not), so the environment read and the fla import stay out of the graph."""
    mode = os.environ.get("K3_KDA_BACKEND", "auto").strip().lower() or "auto"
    if mode == "torch":
        return "torch"
    if mode not in ("auto", "fla"):
        raise ValueError(f"K3_KDA_BACKEND must be 'auto', 'torch' or 'fla', got {mode!r}")
    usable = device.type == "cuda" and _load_fla() is not None
    if mode == "fla" and not usable:
        raise RuntimeError(f"K3_KDA_BACKEND=fla but fla chunk_kda is unusable on {device}")
    return "fla" if usable else "torch"


class KDAGate(NamedTuple):
    """The gate parameters of one KDA layer: A_log [H], dt_bias [H*K], the lower bound (K3's
    -5; None: Kimi Linear's unbounded softplus gate)."""

    A_log: Tensor
    dt_bias: Tensor
    lower_bound: float | None


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """Log-decay g [B, T, H, D] (fp32, fp64 for fp64 f) from the gate pre-activation f:
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, or ``-exp(A_log) * softplus(f +
    dt_bias)`` without a bound (fla's ``naive_kda_lowerbound_gate`` / ``naive_kda_gate``)."""
    H, D = f.shape[-2:]
    compute = torch.promote_types(f.dtype, torch.float32)
    x = f.to(compute) + dt_bias.to(compute).view(H, D)
    a = A_log.to(compute).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def kda_prologue(q: Tensor, k: Tensor, f: Tensor, b: Tensor, gate: KDAGate
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(L2-normalised q, k; the log-decay g; beta = sigmoid(b) in g's dtype): the inputs of
    ``chunk_kda`` from the layer's raw projections, in PyTorch."""
    g = kda_gate(f, gate.A_log, gate.dt_bias, gate.lower_bound)
    return l2_norm(q), l2_norm(k), g, torch.sigmoid(b.to(g.dtype))


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens_cpu: Tensor | None = None,
    gate: KDAGate | None = None,
) -> KDAOut:
    """Public KDA op (fla-compatible semantics).

    Returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 inputs
    on the reference) or None). ``chunk_size``: the reference's chunk; fla gets it where it
    takes one (>= 0.5.1, 32 or 64 only; otherwise fla tiles by 64: the result is the same up to
    rounding). ``cu_seqlens_cpu``: optional host copy of ``cu_seqlens`` for fla (>= 0.4.2), so it
    builds its chunk indices without reading the device tensor; the reference ignores it.

    ``gate`` (what the layer passes): q and k are taken before their L2 norm, g is the gate
    pre-activation [B, T, H, K] and beta the logits [B, T, H]. On the fla backend the prologue
    then goes to fla with the recurrence (``k3::chunk_kda_fla`` with ``gate_in_kernel``: fla's
    ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` with A_log and dt_bias,
    ``use_beta_sigmoid_in_kernel``, and ``safe_gate`` with ``lower_bound`` for K3's bounded
    gate), so the fp32 gate tensor is never written and fla's gradients reach A_log and
    dt_bias; elsewhere ``kda_prologue`` runs first.
    """
    if kda_backend(q.device) == "fla":
        return _chunk_kda_fla(q, k, v, g, beta, scale, initial_state, output_final_state,
                              cu_seqlens, chunk_size, cu_seqlens_cpu, gate)
    if gate is not None:
        q, k, g, beta = kda_prologue(q, k, g, beta, gate)
    return chunk_kda_reference(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        g_lower_bound=None if gate is None else gate.lower_bound,
    )


# ----------------------------------------------------------------------------- fla custom ops
def _chunk_kda_fla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
    initial_state: Tensor | None, output_final_state: bool, cu_seqlens: Tensor | None,
    chunk_size: int, cu_seqlens_cpu: Tensor | None, gate: KDAGate | None = None,
) -> KDAOut:
    """fla's chunk_kda through ``k3::chunk_kda_fla``: shapes checked here, no data read.
    With ``gate``, q/k are un-normalised, g is the gate pre-activation and beta the logits."""
    B, T, H, K = q.shape
    if cu_seqlens is not None:
        if B != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens needs B == 1 and shape [N+1] with N >= 1")
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be a host tensor, got {cu_seqlens_cpu.device}")
    else:
        cu_seqlens_cpu = None
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = None
    if initial_state is not None:
        if initial_state.shape != (N, H, K, v.shape[-1]):
            raise ValueError(f"initial_state must be {(N, H, K, v.shape[-1])}, "
                             f"got {tuple(initial_state.shape)}")
        h0 = initial_state.to(torch.float32)  # fla requires fp32 states
    scale = K**-0.5 if scale is None else float(scale)
    A_log = dt_bias = lower_bound = None
    if gate is not None:  # fp32 like the reference's gate math (FSDP2 may hand bf16 copies)
        A_log, dt_bias = gate.A_log.to(torch.float32), gate.dt_bias.to(torch.float32)
        lower_bound = gate.lower_bound
    o, ht = _fla_fwd_op(q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, scale,
                        bool(output_final_state), int(chunk_size), A_log, dt_bias, lower_bound,
                        gate is not None)
    return o, (ht if output_final_state else None)


def _fla_takes_gate(fla_fn: Callable[..., object], lower_bound: float | None) -> bool:
    """Whether fla_fn can compute the gate prologue for this lower bound in its kernels."""
    in_range = lower_bound is None or -5.0 <= lower_bound < 0.0
    return in_range and _FLA_GATE_ARGS <= _fla_accepts(fla_fn)


def _call_fla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
    output_final_state: bool, chunk_size: int, A_log: Tensor | None, dt_bias: Tensor | None,
    lower_bound: float | None, gate_in_kernel: bool,
) -> tuple[Tensor, Tensor | None]:
    """One call of fla's chunk_kda. With ``gate_in_kernel`` fla normalises q/k, activates the
    gate and beta itself when the installed fla can (else ``kda_prologue`` runs first, in
    PyTorch, differentiably: the backward op re-runs this under autograd)."""
    fla_fn = _load_fla()
    if fla_fn is None:
        raise RuntimeError("k3::chunk_kda_fla needs fla (fla-core) and Triton on a CUDA device")
    accepts = _fla_accepts(fla_fn)
    kwargs: dict[str, object] = {}
    if "chunk_size" in accepts and chunk_size in _FLA_CHUNK_SIZES:
        kwargs["chunk_size"] = chunk_size
    if "cu_seqlens_cpu" in accepts and cu_seqlens_cpu is not None:
        kwargs["cu_seqlens_cpu"] = cu_seqlens_cpu
    if gate_in_kernel:
        assert A_log is not None and dt_bias is not None
        if _fla_takes_gate(fla_fn, lower_bound):
            kwargs.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                          use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound is not None,
                          lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)
        else:
            q, k, g, beta = kda_prologue(q, k, g, beta, KDAGate(A_log, dt_bias, lower_bound))
    o, ht = fla_fn(q, k, v, g, beta, scale=scale, initial_state=h0,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
    return o, ht


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Tensor | None,
                 output_final_state: bool) -> tuple[int, ...]:
    if not output_final_state:
        return (0,)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (N, q.shape[2], q.shape[3], v.shape[3])


@torch.library.custom_op("k3::chunk_kda_fla", mutates_args=())
def _fla_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
    output_final_state: bool, chunk_size: int, A_log: Tensor | None, dt_bias: Tensor | None,
    lower_bound: float | None, gate_in_kernel: bool,
) -> tuple[Tensor, Tensor]:
    """fla chunk_kda forward: (o in v's dtype, final state fp32 [N, H, K, V], or [0] if not
    requested). The real implementation imports fla lazily (this op exists on every machine).
    ``gate_in_kernel``: q/k raw, g the gate pre-activation, beta logits (``chunk_kda(gate=)``)."""
    with torch.no_grad():
        o, ht = _call_fla(q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, scale,
                          output_final_state, chunk_size, A_log, dt_bias, lower_bound,
                          gate_in_kernel)
    if ht is None or not output_final_state:
        ht = q.new_empty(0, dtype=torch.float32)
    return o.to(v.dtype), ht.to(torch.float32)


@_fla_fwd_op.register_fake
def _(q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, scale, output_final_state, chunk_size,
      A_log, dt_bias, lower_bound, gate_in_kernel):
    return (v.new_empty(v.shape),
            q.new_empty(_state_shape(q, v, cu_seqlens, output_final_state), dtype=torch.float32))


def _autograd_keys() -> torch._C.DispatchKeySet:
    """The dispatch keys a custom op's implementation runs without: c10's
    autograd_dispatch_keyset, the set torch._C._AutoDispatchBelowAutograd excludes."""
    key, keyset = torch._C.DispatchKey, torch._C.DispatchKeySet
    return (keyset(key.AutogradFunctionality) | keyset(key.AutogradOther)
            | keyset(key.AutogradNestedTensor))


@contextlib.contextmanager
def _autograd_inside_custom_op() -> Iterator[None]:
    """Record autograd graphs inside a custom op's implementation.

    The dispatcher runs a custom op's kernel with the autograd keys excluded (so torch ops
    inside build no graph even under enable_grad); this re-includes only those keys. Private
    torch API (torch._C._ForceDispatchKeyGuard, DispatchKeySet), present since torch 2.1;
    test_fla_custom_ops_call_fla_by_its_contract fails if it stops working."""
    exclude = torch._C._dispatch_tls_local_exclude_set() - _autograd_keys()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        with torch.enable_grad():
            yield


@torch.library.custom_op("k3::chunk_kda_fla_bwd", mutates_args=())
def _fla_bwd_op(
    do: Tensor, dht: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    h0: Tensor | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
    output_final_state: bool, chunk_size: int, A_log: Tensor | None, dt_bias: Tensor | None,
    lower_bound: float | None, gate_in_kernel: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias; [0] for absent inputs) of
    k3::chunk_kda_fla.

    Re-runs fla's own autograd chunk_kda on detached inputs and calls torch.autograd.grad: it
    relies on fla's public function only, not on its private fwd/bwd signatures (which changed
    across 0.4-0.6). Cost: one extra fla forward per backward (not yet timed on a GPU), and
    the activations fla saves live only during this op; the custom op saves just its inputs.
    No double backward."""
    with _autograd_inside_custom_op():
        xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        opt = [None if x is None else x.detach().requires_grad_() for x in (h0, A_log, dt_bias)]
        o, ht = _call_fla(*xs, opt[0], cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
                          chunk_size, opt[1], opt[2], lower_bound, gate_in_kernel)
        outs, grads = [o], [do.to(o.dtype)]
        if output_final_state and dht is not None and ht is not None:
            outs.append(ht)
            grads.append(dht.to(ht.dtype))
        leaves = xs + [x for x in opt if x is not None]
        got = iter(torch.autograd.grad(outs, leaves, grads, allow_unused=True))
    res = []
    for x in xs + opt:
        if x is None:
            res.append(q.new_empty(0, dtype=torch.float32))
            continue
        d = next(got)
        res.append(torch.zeros_like(x) if d is None else d.to(x.dtype))
    inputs = (do, dht, q, k, v, g, beta, h0, A_log, dt_bias)  # outputs may not alias inputs
    return tuple(r.clone() if any(r is x for x in inputs) else r for r in res)  # type: ignore


@_fla_bwd_op.register_fake
def _(do, dht, q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      chunk_size, A_log, dt_bias, lower_bound, gate_in_kernel):
    opt = [q.new_empty(0, dtype=torch.float32) if x is None else torch.empty_like(x)
           for x in (h0, A_log, dt_bias)]
    return (*(torch.empty_like(x) for x in (q, k, v, g, beta)), *opt)


def _fla_setup_context(ctx, inputs, output) -> None:
    (q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, scale, output_final_state, chunk_size,
     A_log, dt_bias, lower_bound, gate_in_kernel) = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias)
    ctx.opts = (scale, output_final_state, chunk_size, lower_bound, gate_in_kernel)


def _fla_backward(ctx, do: Tensor, dht: Tensor):
    q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias = ctx.saved_tensors
    scale, output_final_state, chunk_size, lower_bound, gate_in_kernel = ctx.opts
    grads = _fla_bwd_op(do, dht if output_final_state else None, q, k, v, g, beta, h0,
                        cu_seqlens, cu_seqlens_cpu, scale, output_final_state, chunk_size,
                        A_log, dt_bias, lower_bound, gate_in_kernel)
    dh0, dA, dbias = (None if x is None else d for x, d in zip((h0, A_log, dt_bias), grads[5:]))
    return (*grads[:5], dh0, None, None, None, None, None, dA, dbias, None, None)


_fla_fwd_op.register_autograd(_fla_backward, setup_context=_fla_setup_context)


# ----------------------------------------------------------------------------- shared helpers
def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
    initial_state: Tensor | None, cu_seqlens: Tensor | None,
) -> tuple[list[Tensor], float, Tensor | None]:
    """Validate shapes (never data), pick the compute dtype and cast everything to it."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a shape, got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"bad v {tuple(v.shape)} / beta {tuple(beta.shape)} for q {q.shape}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if cu_seqlens is not None and (B != 1 or N < 1 or cu_seqlens.dim() != 1
                                   or cu_seqlens.dtype.is_floating_point):
        raise ValueError("cu_seqlens needs B == 1 and an integer shape [N+1] with N >= 1")
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be {(N, H, K, V)}, got {tuple(initial_state.shape)}")
    xs = [q, k, v, g, beta] + ([] if initial_state is None else [initial_state])
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    s0 = None if initial_state is None else initial_state.to(dtype)
    scale = K**-0.5 if scale is None else scale
    return [x.to(dtype) for x in (q, k, v, g, beta)], scale, s0


def _doc_ids(cu: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """(doc [T] document of each token, pos [T] its position in the document); cu long [N+1]."""
    tok = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu[1:], tok, right=True)  # skips empty documents
    return doc, tok - cu.index_select(0, doc)


def _final_states(ends: Tensor, idx: Tensor, empty: Tensor, s0: Tensor | None) -> Tensor:
    """Per-document final states [N, H, K, V]: ends[idx] ([M, H, K, V] stack of states), or the
    initial state (zeros) where the document is empty."""
    keep = s0 if s0 is not None else ends.new_zeros(idx.shape[0], *ends.shape[1:])
    if ends.shape[0] == 0:  # T == 0: every document is empty
        return keep
    got = ends.index_select(0, idx)
    return torch.where(empty.view(-1, 1, 1, 1), keep, got)


# ----------------------------------------------------------------------------- recurrence
def _recurrent_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None, scale: float,
    cu: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token loop. Varlen (cu long [N+1], B == 1): the state restarts from s0[doc] (or zeros)
    at each document's first token, and the final states are read at each document's end."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu is None:
        S = q.new_zeros(B, H, K, V) if s0 is None else s0  # [B, H, K, V]
    else:
        S = q.new_zeros(1, H, K, V)
        doc, pos = _doc_ids(cu, T)
        start = (pos == 0).to(q.dtype)  # [T] 1.0 at a document's first token
    outs, states = [], []
    q_t, k_t, v_t, g_t, b_t = (x.unbind(1) for x in (q, k, v, g, beta))  # one unbind each
    for t in range(T):
        if cu is not None:
            S = S * (1.0 - start[t])
            if s0 is not None:
                S = S + start[t] * s0.index_select(0, doc[t : t + 1])
        S = S * g_t[t].exp().unsqueeze(-1)  # S' = Diag(exp(g_t)) S
        pred = torch.einsum("bhk,bhkv->bhv", k_t[t], S)  # S'^T k_t
        u = b_t[t].unsqueeze(-1) * (v_t[t] - pred)  # [B, H, V]
        S = S + k_t[t].unsqueeze(-1) * u.unsqueeze(-2)  # S' + k_t u^T
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q_t[t], S))
        if cu is not None:
            states.append(S[0])
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)  # [B, T, H, V]
    if cu is None:
        return o, S  # S: [B, H, K, V]
    ends = torch.stack(states) if states else q.new_zeros(0, H, K, V)  # [T, H, K, V]
    empty = cu[1:] == cu[:-1]
    return o, _final_states(ends, (cu[1:] - 1).clamp(min=0), empty, s0)


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> KDAOut:
    """Token-by-token KDA recurrence (oracle / decode). Same contract as ``chunk_kda``."""
    xs, scale, s0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long)
    o, S = _recurrent_fwd(*xs, s0, scale, cu)
    return o.to(v.dtype), (S if output_final_state else None)


# ------------------------------------------------------------------------ chunked (UT transform)
def _dense_chunks(x: Tensor, C: int) -> Tensor:
    """[B, T, H, D] -> [B, H, NT, C, D], T zero-padded to NT * C (NT >= 1)."""
    B, T, H, D = x.shape
    NT = max(1, -(-T // C))
    if NT * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, NT * C - T))
    return x.reshape(B, NT, C, H, D).permute(0, 3, 1, 2, 4)


def _doc_layout(cu: Tensor, T: int, C: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Document-aligned chunk layout of a packed row, from cu (long [N+1]) with no host read.

    Returns (slot [T] position of each token in the NC * C layout, start [NC] bool: a document
    begins at this chunk, chunk_doc [NC] the chunk's document (clamped to N-1 past the last
    one), chunk_off [N+1] first chunk of each document, NC). NC is a static bound from shapes:
    sum_i ceil(len_i / C) <= (T + N' (C - 1)) / C, N' = min(N, T) non-empty documents at most."""
    N = cu.numel() - 1
    n_chunks = torch.div(cu[1:] - cu[:-1] + (C - 1), C, rounding_mode="floor")  # [N]
    chunk_off = F.pad(n_chunks.cumsum(0), (1, 0))  # [N+1]
    NC = max(1, (T + min(N, T) * (C - 1)) // C)
    doc, pos = _doc_ids(cu, T)
    slot = chunk_off.index_select(0, doc) * C + pos  # [T]
    chunk = torch.arange(NC, device=cu.device)
    chunk_doc = torch.searchsorted(chunk_off[1:], chunk, right=True)  # [NC], N past the end
    inside = chunk_doc < N
    chunk_doc = chunk_doc.clamp(max=N - 1)
    start = inside & (chunk == chunk_off.index_select(0, chunk_doc))
    return slot, start, chunk_doc, chunk_off, NC


def _chunk_varlen(
    xs: list[Tensor], s0: Tensor | None, cu_seqlens: Tensor, scale: float, C: int,
    output_final_state: bool, g_min: float | None,
) -> tuple[Tensor, Tensor | None]:
    q = xs[0]
    T, H = q.shape[1], q.shape[2]
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    slot, start, chunk_doc, chunk_off, NC = _doc_layout(cu, T, C)

    def to_chunks(x: Tensor) -> Tensor:  # [1, T, H, D] -> [1, H, NC, C, D]
        buf = x.new_zeros(NC * C, *x.shape[2:]).index_copy_(0, slot, x[0])  # in place: no clone
        return buf.view(1, NC, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = (to_chunks(x) for x in xs[:4])
    beta = to_chunks(xs[4].unsqueeze(-1))
    o, ends, _ = chunk_core(q, k, v, g, beta, s0, scale, start.to(q.dtype), chunk_doc,
                            keep_ends=output_final_state, g_min=g_min)
    o = o.permute(0, 2, 3, 1, 4).reshape(NC * C, H, -1).index_select(0, slot)  # [T, H, V]
    S = None
    if ends is not None:
        S = _final_states(ends, chunk_off[1:], cu[1:] == cu[:-1], s0)  # [N, H, K, V]
    return o.unsqueeze(0), S


def chunk_kda_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    g_lower_bound: float | None = None,
) -> KDAOut:
    """Chunked (WY/UT-transform) KDA in pure PyTorch. Same contract as ``chunk_kda``.

    Output is cast to v's dtype; the final state is float32 (float64 for float64 inputs).
    Varlen uses the document-aligned chunk layout (module docstring): each document is padded
    to a multiple of chunk_size only. No host synchronisation anywhere. ``g_lower_bound``: a
    bound with g >= it everywhere (K3's gate guarantees its ``lower_bound``), which lets the
    intra-chunk scores use larger blocks (``model.ops.kda_chunk.diag_block``); None for any g.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    xs, scale, s0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        o, S = _chunk_varlen(xs, s0, cu_seqlens, scale, chunk_size, output_final_state,
                             g_lower_bound)
        return o.to(v.dtype), S
    B, T, H, _ = q.shape
    qc, kc, vc, gc = (_dense_chunks(x, chunk_size) for x in xs[:4])
    bc = _dense_chunks(xs[4].unsqueeze(-1), chunk_size)
    o, _, S = chunk_core(qc, kc, vc, gc, bc, s0, scale, g_min=g_lower_bound)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, -1, H, o.shape[-1])[:, :T]  # [B, T, H, V]
    return o.to(v.dtype), (S if output_final_state else None)

"""Kimi Delta Attention (KDA) operator: public op, backend dispatch and PyTorch references.

What it is for (design doc §1.1, §1.5-1.7):
* ``chunk_kda``: the op the model calls. On CUDA with ``fla`` importable it dispatches to
  ``fla.ops.kda.chunk_kda`` (Triton, plain semantics: no in-kernel gate/L2-norm/sigmoid); everywhere
  else (CPU CI, no Triton, or ``K3_KDA_BACKEND=torch``) it runs ``chunk_kda_reference``.
* ``chunk_kda_reference``: the chunkwise WY/UT-transform algorithm in pure PyTorch (float32, or
  float64 for float64 inputs), differentiable by autograd, with a Python loop over chunks only.
* ``recurrent_kda``: the token-by-token recurrence; the test oracle and a simple decode path.

Semantics (per head, state layout [K, V]): S' = Diag(exp(g_t)) S; u = beta_t (v_t - S'^T k_t);
S = S' + k_t u^T; o_t = scale * S^T q_t. Inputs: q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K] log-decay (<= 0, already activated); beta [B, T, H] (already in (0, 1)).
Varlen: ``cu_seqlens`` [N+1] (FlashAttention convention, B == 1) packs N independent sequences along
T; states are then per sequence, [N, H, K, V].

What it deliberately does NOT do: gate activation (A_log/dt_bias), q/k L2-norm, beta sigmoid
(callers do these; fla's ``use_*_in_kernel`` flags are never set), GVA (H_v != H), the V-first
state layout, safe_gate/lower_bound, context parallelism, or a hand-written backward. The reference
is not a fast kernel: its intra-chunk part materialises [B, H, T, C, K] tensors (C = chunk size).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
KDAOut = tuple[Tensor, Tensor | None]

__all__ = ["chunk_kda", "chunk_kda_reference", "kda_backend", "recurrent_kda"]


# ----------------------------------------------------------------------------- backend dispatch
@functools.cache
def _load_fla() -> Callable[..., KDAOut] | None:
    """Import fla's chunk_kda once; None if fla (or Triton under it) cannot be imported."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception:  # ImportError, or Triton/CUDA errors raised while fla imports
        return None
    return fla_chunk_kda


def kda_backend(device: torch.device | str) -> str:
    """Backend chunk_kda uses for tensors on ``device``: "fla" or "torch".

    ``K3_KDA_BACKEND``: "auto" (default: fla on CUDA when importable), "torch" (always the
    reference) or "fla" (require fla; raises if it cannot be used on ``device``).
    """
    mode = os.environ.get("K3_KDA_BACKEND", "auto").strip().lower() or "auto"
    if mode == "torch":
        return "torch"
    if mode not in ("auto", "fla"):
        raise ValueError(f"K3_KDA_BACKEND must be 'auto', 'torch' or 'fla', got {mode!r}")
    usable = torch.device(device).type == "cuda" and _load_fla() is not None
    if mode == "fla" and not usable:
        raise RuntimeError(f"K3_KDA_BACKEND=fla but fla chunk_kda is unusable on {device}")
    return "fla" if usable else "torch"


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
) -> KDAOut:
    """Public KDA op (fla-compatible plain semantics).

    Returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or None).
    `chunk_size` applies to the PyTorch reference only (fla picks its own tiling).
    """
    if kda_backend(q.device) == "fla":
        fla_chunk_kda = _load_fla()
        assert fla_chunk_kda is not None
        return fla_chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )
    return chunk_kda_reference(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )


# ----------------------------------------------------------------------------- shared helpers
def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
    initial_state: Tensor | None, cu_seqlens: Tensor | None,
) -> tuple[list[Tensor], float, Tensor | None]:
    """Validate shapes, pick the compute dtype and cast everything to it."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a shape, got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"bad v {tuple(v.shape)} / beta {tuple(beta.shape)} for q {q.shape}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if cu_seqlens is not None and (B != 1 or N < 1):
        raise ValueError("cu_seqlens needs B == 1 and at least one sequence")
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be {(N, H, K, V)}, got {tuple(initial_state.shape)}")
    xs = [q, k, v, g, beta] + ([] if initial_state is None else [initial_state])
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    s0 = None if initial_state is None else initial_state.to(dtype)
    scale = K**-0.5 if scale is None else scale
    return [x.to(dtype) for x in (q, k, v, g, beta)], scale, s0


def _varlen_index(cu_seqlens: Tensor, T: int, multiple: int) -> tuple[Tensor, Tensor, int, int]:
    """Token -> (sequence, position) maps for scattering packed tokens into a padded batch."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]  # [N]
    first, last, min_len, max_len = torch.stack(
        [cu[0], cu[-1], lengths.min(), lengths.max()]).tolist()  # one host sync
    if first != 0 or last != T or min_len < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu_seqlens.tolist()}")
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths,
                                  output_size=T)  # [T] sequence id of each token
    pos = torch.arange(T, device=cu.device) - cu[seq]  # [T] position inside its sequence
    t_pad = max(1, math.ceil(max_len / multiple)) * multiple
    return seq, pos, t_pad, lengths.numel()


def _run_varlen(
    fn: Callable[..., tuple[Tensor, Tensor]], xs: list[Tensor], s0: Tensor | None,
    cu_seqlens: Tensor, multiple: int,
) -> tuple[Tensor, Tensor]:
    """Run ``fn`` on a right-padded batch [N, T_pad, ...]; padding (all zeros) is an exact no-op."""
    T = xs[0].shape[1]
    seq, pos, t_pad, N = _varlen_index(cu_seqlens.to(xs[0].device), T, multiple)

    def scatter(x: Tensor) -> Tensor:
        out = x.new_zeros(N, t_pad, *x.shape[2:])  # [N, T_pad, H, ...]
        out[seq, pos] = x[0]  # x[0]: [T, H, ...]
        return out

    o_pad, s_final = fn(*[scatter(x) for x in xs], s0)  # o_pad [N, T_pad, H, V]
    return o_pad[seq, pos].unsqueeze(0), s_final  # [1, T, H, V], [N, H, K, V]


# ----------------------------------------------------------------------------- recurrence
def _recurrent_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None, scale: float,
) -> tuple[Tensor, Tensor]:
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if s0 is None else s0  # [B, H, K, V]
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # S' = Diag(exp(g_t)) S
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # S'^T k_t
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)  # [B, H, V]
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)  # S' + k_t u^T
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, v.shape[-1])  # [B, T, H, V]
    return o, S  # S: [B, H, K, V]


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
    fn = functools.partial(_recurrent_fwd, scale=scale)
    if cu_seqlens is None:
        o, S = fn(*xs, s0)
    else:
        o, S = _run_varlen(fn, xs, s0, cu_seqlens, multiple=1)
    return o.to(v.dtype), (S if output_final_state else None)


# ------------------------------------------------------------------------ chunked (UT transform)
_INTRA_BUDGET = 1 << 21  # elements per [.., C, C, K] temporary (8 MiB fp32), see _intra_scores
# Largest in-chunk decay span (nats) for which the factored matmul form is used: both factors stay
# within exp(+-span/2), far inside the float range (fp32 max ~ e^88). K3's lower-bounded gate
# (g >= -5) with 16-token chunks always qualifies, the same argument as fla's safe-gate kernels.
_FACTOR_SPAN = {torch.float32: 60.0, torch.float64: 600.0}


def _intra_scores_factored(q: Tensor, k: Tensor, G: Tensor) -> Tensor:
    """Same result as `_intra_scores`, via exp(G_r - G_i) = exp(G_r - c) exp(c - G_i).

    c is the middle of each chunk's decay range, so every factor is at most exp(span / 2): two
    [C, K] x [K, C] matmuls per chunk instead of a [C, C, K] broadcast.
    """
    c = 0.5 * (G[..., :1, :] + G[..., -1:, :])  # [B, H, n, 1, K]
    k_inv = k * (c - G).exp()  # [B, H, n, C(i), K]
    rows = torch.stack([k, q], dim=2) * (G - c).exp().unsqueeze(2)  # [B, H, 2, n, C(r), K]
    return (rows @ k_inv.unsqueeze(2).transpose(-1, -2)).movedim(2, -1)  # [B, H, n, C, C, 2]


def _intra_scores(q: Tensor, k: Tensor, G: Tensor, causal: Tensor) -> Tensor:
    """[.., r, i, :] = (<k_r, exp(G_r - G_i) k_i>, <q_r, exp(G_r - G_i) k_i>) for i <= r, else 0.

    Inputs [B, H, n, C, K]. The [B, H, n, C, C, K] temporaries are kept small by the caller (a few
    MiB): fresh large CPU allocations cost more in page faults than the arithmetic itself.
    """
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B, H, n, C(r), C(i), K] = G_r - G_i
    # Clamp to [log(sqrt(tiny)), 0] before exp: no overflow above the diagonal (G_r - G_i > 0
    # there; those scores are zeroed below, and clamp passes them no gradient) and no slow x86
    # subnormals below (error < 1e-19). Cheaper than exp of a -inf mask.
    floor = 0.5 * math.log(torch.finfo(G.dtype).tiny)
    decay = diff.clamp(min=floor, max=0.0).exp()
    kdec = decay * k.unsqueeze(-3)  # [B, H, n, C(r), C(i), K] = exp(G_r - G_i) * k_i
    scores = kdec @ torch.stack([k, q], dim=-1)  # [B, H, n, C(r), C(i), 2]
    return scores * causal.unsqueeze(-1).to(scores.dtype)  # keep i <= r only


def _chunk_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None, scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Chunked KDA on a dense batch; T is padded to a multiple of chunk_size with no-op tokens."""
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    NT = max(1, math.ceil(T / C))
    pad = NT * C - T
    if pad:  # g=k=v=q=beta=0 tokens leave the state unchanged and are sliced off below
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))

    def chunks(x: Tensor) -> Tensor:  # [B, NT*C, H, D] -> [B, H, NT, C, D]
        return x.reshape(B, NT, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = (chunks(x) for x in (q, k, v, g))
    b = chunks(beta.unsqueeze(-1))  # [B, H, NT, C, 1]
    G = g.cumsum(dim=-2)  # [B, H, NT, C, K] in-chunk cumulative log-decay

    # Intra-chunk part, all chunks at once. exp(G_r - G_i) is only used where i <= r; the upper
    # triangle (G_r - G_i > 0, could overflow) is clamped to 0 before exp and zeroed after.
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [C(r), C(i)]
    span = float((G[..., 0, :] - G[..., -1, :]).detach().max()) if G.numel() else 0.0  # host sync
    if span <= _FACTOR_SPAN.get(G.dtype, 0.0):
        A = _intra_scores_factored(q, k, G) * causal.unsqueeze(-1).to(G.dtype)
    else:  # strong decays (e.g. the unbounded softplus gate): the exact broadcast form
        step = max(1, _INTRA_BUDGET // (B * H * C * C * K))  # chunks per [.., C, C, K] temporary
        A = torch.cat([_intra_scores(q[:, :, s : s + step], k[:, :, s : s + step],
                                     G[:, :, s : s + step], causal)
                       for s in range(0, NT, step)], dim=2)  # [B, H, NT, C(r), C(i), 2]
    A_kk = b * A[..., 0].tril(-1)  # [B, H, NT, C, C] strictly lower, row r scaled by beta_r
    A_qk = A[..., 1]  # [B, H, NT, C, C] lower incl. diagonal (upper already zero)

    # UT transform: (I + A_kk) [W | U] = [beta exp(G) K | beta V], one unit-lower-triangular solve.
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([b * G.exp() * k, b * v], dim=-1)  # [B, H, NT, C, K + V]
    WU = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    W, U = WU.split([K, V], dim=-1)  # [B, H, NT, C, K], [B, H, NT, C, V]

    G_last = G[..., -1:, :]  # [B, H, NT, 1, K]
    k_to_end = k * (G_last - G).exp()  # [B, H, NT, C, K] = K * exp(G_C - G)
    a_end = G_last.squeeze(-2).exp().unsqueeze(-1)  # [B, H, NT, K, 1] = exp(G_C)

    # Inter-chunk recurrence: the only Python loop.
    S = q.new_zeros(B, H, K, V) if s0 is None else s0  # [B, H, K, V]
    states, v_news = [], []
    for n in range(NT):
        v_new = U[:, :, n] - W[:, :, n] @ S  # [B, H, C, V] pseudo-values
        states.append(S)
        v_news.append(v_new)
        S = a_end[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    S_in = torch.stack(states, dim=2)  # [B, H, NT, K, V] state entering each chunk
    V_new = torch.stack(v_news, dim=2)  # [B, H, NT, C, V]

    o = scale * ((q * G.exp()) @ S_in + A_qk @ V_new)  # [B, H, NT, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, NT * C, H, V)[:, :T]  # [B, T, H, V]
    return o, S


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
) -> KDAOut:
    """Chunked (WY/UT-transform) KDA in pure PyTorch. Same contract as ``chunk_kda``.

    Output is cast to v's dtype; the final state is float32 (float64 for float64 inputs).
    Varlen packs the sequences into a right-padded batch [N, T_max (rounded up to chunk_size)].
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    xs, scale, s0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    fn = functools.partial(_chunk_fwd, scale=scale, chunk_size=chunk_size)
    if cu_seqlens is None:
        o, S = fn(*xs, s0)
    else:
        o, S = _run_varlen(fn, xs, s0, cu_seqlens, multiple=chunk_size)
    return o.to(v.dtype), (S if output_final_state else None)

"""The chunked KDA reference's core on the chunk layout, with a hand-written backward.

``chunk_core`` is what ``model.ops.kda.chunk_kda_reference`` runs once its inputs are in the
[B, H, NC, C, D] chunk layout: the intra-chunk scores (``intra_scores``: dyadic blocks, exact
for any decay; with K3's bounded gate, larger diagonal blocks, ``diag_block``), the UT transform
(the explicit inverse (I + beta S_kk)^-1 from one unit-lower-triangular solve against I), the
inter-chunk recurrence (a Python loop over the static chunk count) and the output. It is the
custom op ``k3::kda_chunk`` (forward) / ``k3::kda_chunk_bwd`` (backward): one opaque node in
fake-tensor traces and torch.compile graphs (so compile does not unroll its loops), and a
backward written out by hand, not taped by autograd: autograd's backward of its ~1000 small ops
spent much of its time in zero fills, slice copies and the mirror image of every product (on a
CPU, memory passes are the cost). The forward returns its residuals (W, the inverse's
transpose, the states entering each chunk, the pseudo-values and the two score matrices) as
extra outputs, so the backward recomputes only cheap elementwise factors.

Backward, per chunk (o = scale (Q e^G S_in + A_qk V'), V' = U - W S_in,
S_out = e^{G_C} S_in + (K e^{G_C - G})^T V', [W | U] = (I + A_kk)^{-1} [beta e^G K | beta V]):
the recurrence runs in reverse for dS (two products per chunk); everything else is batched
over chunks: the score, pseudo-value and state products, the UT transform's gradient through
the saved inverse (dR_v = (I + A_kk)^-T dV'), and ``intra_scores_bwd``, which walks the same
blocks as the forward. Exponents are clamped like the forward's (``decay``); where a factor is
clamped, the backward uses the clamped value (a difference below 3e-13 in fp32, 1e-102 in
fp64). No double backward. Validated by the oracle tests of ``tests/unit/test_kda_op.py``
(token recurrence, float64 direct formulas).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

Tensor = torch.Tensor

INTRA_BUDGET = 1 << 20  # elements per [.., C, K] temporary of one chunk group (4 MiB fp32)
_SMALL_BLOCK = 1  # half-block sizes up to this use a broadcast product, larger ones matmul


def decay(x: Tensor) -> Tensor:
    """exp(x) for a log-decay x <= 0, with x clamped at log(tiny)/3 of its dtype: no x86
    subnormals in the factor or in a product of two (a subnormal-producing exp, and every op
    reading its output, runs ~15x slower on CPU). Absolute error < 3e-13 in fp32 (1e-102 in
    fp64); the hand-written backward uses the clamped value, as small as the true one."""
    return x.clamp(min=math.log(torch.finfo(x.dtype).tiny) / 3.0).exp()


# ------------------------------------------------------------------ intra-chunk scores
def _level(k: Tensor, X: Tensor, G: Tensor, h: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Operands of the dyadic level with half-blocks of h tokens (k, G [.., Cp, K], X = [k, q]
    [.., Cp, 2, K]): e_col [.., nb, h, K] = exp(G_s - G_i) over first halves, e_row
    [.., nb, h, 1, K] = exp(G_r - G_s) over second halves (G_s the cumulative decay at each
    first half's last token), k_col = k_i e_col and x_row = X_r e_row [.., nb, h, 2, K]."""
    nb = G.shape[-2] // (2 * h)
    Gv = G.unflatten(-2, (nb, 2, h))  # [.., nb, 2, h, K]
    G_s = Gv[..., 0, h - 1 :, :]  # [.., nb, 1, K]
    e_col = decay(G_s - Gv[..., 0, :, :])
    e_row = decay(Gv[..., 1, :, :] - G_s).unsqueeze(-2)
    k_col = k.unflatten(-2, (nb, 2, h))[..., 0, :, :] * e_col
    x_row = X.unflatten(-3, (nb, 2, h))[..., 1, :, :, :] * e_row
    return e_col, e_row, k_col, x_row


def _diag_level(k: Tensor, X: Tensor, G: Tensor, S: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Operands of the S-token diagonal blocks (bounded gate, ``diag_block``): around each
    block's midpoint token m, e_row = exp(G_r - G_m) [.., n, S, 1, K], e_col = exp(G_m - G_i)
    [.., n, S, K], x_row = X_r e_row [.., n, S, 2, K], k_col = k_i e_col: exp(G_r - G_i) =
    e_row e_col for every pair of the block, each factor within exp(+-|g_min| S / 2)."""
    n = G.shape[-2] // S
    Gv = G.unflatten(-2, (n, S))
    x = Gv - Gv[..., S // 2 : S // 2 + 1, :]
    e_row, e_col = x.exp().unsqueeze(-2), x.neg_().exp_()
    x_row = X.unflatten(-3, (n, S)) * e_row
    k_col = k.unflatten(-2, (n, S)) * e_col
    return e_row, e_col, x_row, k_col


def _diag_view(M: Tensor, S: int) -> Tensor:
    """The S-token diagonal blocks of M [.., Cp(r), 2, Cp(i)] as a view [.., n, S(r), 2, S(i)]."""
    n = M.shape[-1] // S
    Mv = M.unflatten(-1, (n, S)).unflatten(-4, (n, S))  # [.., n, S, 2, n, S]
    return torch.diagonal(Mv, dim1=-5, dim2=-2).movedim(-1, -4)


def _block_mask(S: int, like: Tensor) -> Tensor:
    """[S(r), 1, S(i)]: 1 where i <= r (the causal part of a diagonal block)."""
    return torch.ones(S, S, dtype=like.dtype, device=like.device).tril_().unsqueeze(-2)


def _intra_group(q: Tensor, k: Tensor, G: Tensor, S: int) -> Tensor:
    """Scores of one group of chunks, inputs [B, H, n, Cp, K] (Cp a power of two).

    Returns M [B, H, n, Cp(r), 2, Cp(i)]: (<k_r, exp(G_r - G_i) k_i>, <q_r, exp(G_r - G_i) k_i>)
    for i <= r, 0 above the diagonal. Dyadic blocks: a block of 2h tokens is [[first half, 0],
    [cross, second half]], where cross (rows r in the second half, columns i in the first)
    factors exp(G_r - G_i) = exp(G_r - G_s) exp(G_s - G_i) around G_s, the cumulative decay at
    the first half's last token. G never increases (g <= 0), so both factors are <= 1 for any
    decay: no overflow, no data-dependent choice, and every pair i < r is covered exactly once.
    The recursion stops at diagonal blocks of S tokens: S = 1 is the diagonal itself (i == r
    needs no decay); S > 1 (a bounded gate, ``diag_block``) is one product per block around its
    midpoint (``_diag_level``). Each level's blocks are written into their place in M."""
    B, H, n, Cp, K = q.shape
    X = torch.stack([k, q], dim=-2)  # [B, H, n, Cp, 2, K]: k and q rows side by side
    M = X.new_zeros(B, H, n, Cp, 2, Cp)
    if S == 1:
        torch.diagonal(M, dim1=-3, dim2=-1).copy_((X * k.unsqueeze(-2)).sum(-1).mT)
    else:
        _, _, x_row, k_col = _diag_level(k, X, G, S)
        D = (x_row.flatten(-3, -2) @ k_col.mT).unflatten(-2, (S, 2))  # [.., nS, S, 2, S]
        _diag_view(M, S).copy_(D.mul_(_block_mask(S, D)))
    h = S
    while h < Cp:
        _, _, k_col, x_row = _level(k, X, G, h)
        if h <= _SMALL_BLOCK:  # tiny matrices: a broadcast product beats batched matmul
            cross = (x_row.unsqueeze(-2) * k_col[..., None, None, :, :]).sum(-1)
        else:
            cross = (x_row.flatten(-3, -2) @ k_col.transpose(-1, -2)).unflatten(-2, (h, 2))
        _cross_view(M, h).copy_(cross)  # cross: [.., nb, h(r), 2, h(i)]
        h *= 2
    return M


def _cross_view(M: Tensor, h: int) -> Tensor:
    """The level-h cross blocks of M [.., n, Cp(r), 2, Cp(i)] as a view [.., n, nb, h(r), 2, h(i)]:
    rows in the second half of each 2h block, columns in its first half."""
    Cp = M.shape[-1]
    nb = Cp // (2 * h)
    Mv = M.unflatten(-1, (nb, 2, h)).unflatten(-5, (nb, 2, h))  # [.., nb, 2, h, 2, nb, 2, h]
    blocks = Mv.select(-2, 0).select(-5, 1)  # [.., nb(r), h(r), 2, nb(i), h(i)]
    return torch.diagonal(blocks, dim1=-5, dim2=-2).movedim(-1, -4)


def _intra_group_bwd(q: Tensor, k: Tensor, G: Tensor, dM: Tensor, S: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dG) [B, H, n, Cp, K] of ``_intra_group`` given dM [B, H, n, Cp, 2, Cp] (entries
    above the diagonal are ignored). Per block (x_row = X_r e_row, k_col = k_i e_col):
    d x_row = dblock k_col, d k_col = dblock^T x_row, so d X_r += d x_row e_row and
    d k_i += d k_col e_col. G needs no per-level work: a term depends on G_r - G_i only (the
    reference point cancels), so dG_r = sum_x dX_r^blocks X_r and dG_i = -dk_i^blocks k_i, summed
    over all levels at once from the block parts of dX and dk (a diagonal term i == r adds to
    both and cancels, as it should)."""
    B, H, n, Cp, K = q.shape
    X = torch.stack([k, q], dim=-2)  # [.., Cp, 2, K]
    if S == 1:
        dXc = torch.zeros_like(X)  # block parts of dX and dk
        dkc = torch.zeros_like(k)
    else:
        e_row, e_col, x_row, k_col = _diag_level(k, X, G, S)
        dD = _diag_view(dM, S) * _block_mask(S, dM)  # [.., nS, S(r), 2, S(i)]
        flat = dD.flatten(-3, -2)  # [.., nS, 2S, S]
        dXc = (flat @ k_col).unflatten(-2, (S, 2)).mul_(e_row).flatten(-4, -3)
        dkc = (flat.mT @ x_row.flatten(-3, -2)).mul_(e_col).flatten(-3, -2)
    h = S
    while h < Cp:
        nb = Cp // (2 * h)
        e_col, e_row, k_col, x_row = _level(k, X, G, h)
        dcross = _cross_view(dM, h)  # [.., nb, h(r), 2, h(i)]
        if h <= _SMALL_BLOCK:
            dx_row = (dcross.unsqueeze(-1) * k_col[..., None, None, :, :]).sum(-2)
            dk_col = (dcross.unsqueeze(-1) * x_row.unsqueeze(-2)).sum((-4, -3))
        else:
            flat = dcross.flatten(-3, -2)  # [.., nb, 2h, h]
            dx_row = (flat @ k_col).unflatten(-2, (h, 2))
            dk_col = flat.transpose(-1, -2) @ x_row.flatten(-3, -2)
        dXc.unflatten(-3, (nb, 2, h))[..., 1, :, :, :].addcmul_(dx_row, e_row)
        dkc.unflatten(-2, (nb, 2, h))[..., 0, :, :].addcmul_(dk_col, e_col)
        h *= 2
    dG = (dXc * X).sum(-2).sub_(dkc * k)
    if S == 1:
        d_diag = torch.diagonal(dM, dim1=-3, dim2=-1).mT.unsqueeze(-1)  # [.., Cp, 2, 1]
        dXc.addcmul_(d_diag, k.unsqueeze(-2))  # i == r: <X_r, k_r>
        dkc.add_((d_diag * X).sum(-2))
    return dXc[..., 1, :], dkc.add_(dXc[..., 0, :]), dG


def _pad_pow2(q: Tensor, k: Tensor, G: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Pad the chunk dim C to a power of two Cp with no-op tokens (q = k = 0, G held at the
    chunk's last value: zero scores, sliced off)."""
    C, K = q.shape[-2], q.shape[-1]
    Cp = 1 << (C - 1).bit_length()
    if Cp != C:
        q, k = (F.pad(x, (0, 0, 0, Cp - C)) for x in (q, k))
        G = torch.cat([G, G[..., -1:, :].expand(*G.shape[:-2], Cp - C, K)], dim=-2)
    return q, k, G, Cp


def _group_step(q: Tensor, Cp: int) -> int:
    """Chunks per group: temporaries within INTRA_BUDGET elements (fresh large CPU allocations
    cost more in page faults than the arithmetic)."""
    B, H, _, _, K = q.shape
    return max(1, INTRA_BUDGET // (B * H * Cp * max(K, Cp)))


def diag_block(g_min: float | None, Cp: int, dtype: torch.dtype) -> int:
    """Tokens per diagonal block of ``_intra_group``: 1 for an unbounded gate, else the largest
    power of two S <= Cp with |g_min| S <= log(max of dtype) / 2 (S = 8 for K3's -5 in fp32):
    every exp(+-(G_r - G_m)) of a block, and each masked product above its diagonal (at most
    exp(|g_min| (S - 1)) times a score), stays finite with room for any score. A static choice
    (config and dtype, not data)."""
    if g_min is None:
        return 1
    limit = math.log(torch.finfo(dtype).max) / 2.0
    S = 1
    while 2 * S <= Cp and abs(g_min) * 2 * S <= limit:
        S *= 2
    return S


def intra_scores(q: Tensor, k: Tensor, G: Tensor, g_min: float | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(S_kk, S_qk) [B, H, NC, C(r), C(i)]: <x_r, exp(G_r - G_i) k_i> (x = k, q) for i <= r, else 0.

    Inputs [B, H, NC, C, K]; G is the in-chunk cumulative log-decay. Exact for any decay
    strength (``_intra_group``); ``g_min`` (a lower bound of every per-token log-decay, K3's
    bounded gate) lets its diagonal blocks grow (``diag_block``): fewer, larger products, the
    same result to rounding. Chunks go in groups (``_group_step``)."""
    C, NC = q.shape[-2], q.shape[2]
    q, k, G, Cp = _pad_pow2(q, k, G)
    S = diag_block(g_min, Cp, q.dtype)
    step = _group_step(q, Cp)
    parts = [_intra_group(q[:, :, s : s + step], k[:, :, s : s + step], G[:, :, s : s + step], S)
             for s in range(0, NC, step)]
    M = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # [B, H, NC, Cp, 2, Cp]
    M = M[..., :C, :, :C]
    return M[..., 0, :], M[..., 1, :]


def intra_scores_bwd(q: Tensor, k: Tensor, G: Tensor, d_kk: Tensor, d_qk: Tensor,
                     g_min: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dG) [B, H, NC, C, K] of ``intra_scores`` for gradients d_kk, d_qk [.., C, C]
    of its two outputs (only their lower triangles, diagonal included, are read)."""
    C, NC = q.shape[-2], q.shape[2]
    q, k, G, Cp = _pad_pow2(q, k, G)
    S = diag_block(g_min, Cp, q.dtype)
    dM = torch.stack([d_kk, d_qk], dim=-2)  # [.., C, 2, C]
    if Cp != C:
        dM = F.pad(dM, (0, Cp - C, 0, 0, 0, Cp - C))
    step = _group_step(q, Cp)
    parts = [_intra_group_bwd(q[:, :, s : s + step], k[:, :, s : s + step],
                              G[:, :, s : s + step], dM[:, :, s : s + step], S)
             for s in range(0, NC, step)]
    outs = [torch.cat(p, dim=2) for p in zip(*parts)] if len(parts) > 1 else parts[0]
    return tuple(x[..., :C, :] for x in outs)  # type: ignore[return-value]


# ------------------------------------------------------------------ forward and backward
def _flat(x: Tensor) -> Tensor:
    """[B, H, NC, m, n] -> [B H NC, m, n] (a view for the contiguous tensors here) for bmm."""
    return x.reshape(-1, *x.shape[-2:])


def _chunk_factors(g: Tensor, k: Tensor) -> tuple[Tensor, ...]:
    """Decays of the chunk layout shared by forward and backward: (G = in-chunk cumsum of g,
    exp(G), exp(G_C - G), k_to_end = K exp(G_C - G), a_end = exp(G_C) [.., NC, K, 1])."""
    G = g.cumsum(dim=-2)
    G_last = G[..., -1:, :]  # [.., NC, 1, K]
    e_end = decay(G_last - G)
    return G, decay(G), e_end, k * e_end, decay(G_last.squeeze(-2)).unsqueeze(-1)


def _chunk_fwd_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    s0: Tensor | None, start: Tensor | None, chunk_doc: Tensor | None,
                    scale: float, keep_ends: bool, g_min: float | None = None
                    ) -> tuple[Tensor, ...]:
    """(o, ends, S, residuals...) of ``chunk_core``; residuals: W [.., C, K] (the UT
    transform's keys), AinvT [.., C, C] ((I + beta S_kk)^-T), S_in [.., NC, K, V] (state entering
    each chunk), V_new [.., C, V] (pseudo-values), S_kk [.., C, C] (strictly lower key scores),
    A_qk [.., C, C] (query scores, i <= r)."""
    B, H, NC, C, K = q.shape
    V = v.shape[-1]
    G, e_G, _, k_to_end, a_end = _chunk_factors(g, k)
    S_kk, A_qk = intra_scores(q, k, G, g_min)
    S_kk = S_kk.tril(-1)
    # UT transform: [W | U] = (I + beta S_kk)^-1 diag(beta) [exp(G) K | V], through the explicit
    # inverse (one solve against I, C columns, not K + V; unitriangular=True never reads the
    # diagonal): two row-major products, no strided copies, and the backward reuses it.
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(B, H, NC, C, C)
    AinvT = torch.linalg.solve_triangular(beta * S_kk, eye, upper=False,
                                          unitriangular=True).mT.contiguous()
    P = (AinvT * beta).mT  # Ainv diag(beta)
    W = P @ (k * e_G)
    U = P @ v
    # Inter-chunk recurrence over the (static) chunk count; operands from one unbind each.
    U_n, W_n, a_n = U.unbind(2), W.unbind(2), a_end.unbind(2)
    kt_n = k_to_end.transpose(-1, -2).unbind(2)  # [B, H, K, C] each
    if start is None:
        S = q.new_zeros(B, H, K, V) if s0 is None else s0
    else:
        S = q.new_zeros(1, H, K, V)
        keep_n = (1.0 - start).unbind(0)
        if s0 is not None:  # the state entering a document's first chunk: its initial state
            init_n = (s0.index_select(0, chunk_doc) * start.view(-1, 1, 1, 1)).unbind(0)
    # the loop writes each chunk's entering state and pseudo-values into their slots while
    # they are in cache (a stack of 2 NC tensors afterwards re-read them from memory)
    S_in = q.new_empty(B, H, NC, K, V)
    V_new = v.new_empty(B, H, NC, C, V)
    S_in_n, V_new_n = S_in.unbind(2), V_new.unbind(2)
    ends = []
    for n in range(NC):
        if start is not None:
            if keep_ends:
                ends.append(S[0])
            S = S * keep_n[n]  # reset where a document starts
            if s0 is not None:
                S = S + init_n[n]
        S_in_n[n].copy_(S)
        v_new = torch.sub(U_n[n], W_n[n] @ S, out=V_new_n[n])  # [B, H, C, V] pseudo-values
        S = torch.baddbmm(_flat(a_n[n] * S), _flat(kt_n[n]), _flat(v_new)).view(S.shape)
    o = _flat(q * e_G) @ _flat(S_in)  # [B H NC, C, V]
    o = torch.baddbmm(o, _flat(A_qk), _flat(V_new), beta=scale, alpha=scale).view(v.shape)
    ends_t = torch.stack([*ends, S[0]]) if keep_ends else q.new_zeros(0)
    # custom-op outputs have the fake implementation's (contiguous) strides
    return o, ends_t, S, W, AinvT, S_in, V_new, S_kk, A_qk.contiguous()


def _chunk_bwd_impl(do: Tensor, d_ends: Tensor | None, dS_out: Tensor | None, q: Tensor,
                    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None,
                    start: Tensor | None, chunk_doc: Tensor | None, W: Tensor, AinvT: Tensor,
                    S_in: Tensor, V_new: Tensor, S_kk: Tensor, A_qk: Tensor, scale: float,
                    keep_ends: bool, g_min: float | None = None) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dg, dbeta, ds0 or [0]) of ``chunk_core`` (module docstring)."""
    B, H, NC, C, K = q.shape
    G, e_G, e_end, k_to_end, a_end = _chunk_factors(g, k)
    q_dec = q * e_G
    do_s = do * scale
    # o = scale (q_dec S_in + A_qk V_new): everything but the recurrence, batched over chunks
    d_qdec = do_s @ S_in.transpose(-1, -2)  # [.., C, K]
    d_qk = do_s @ V_new.transpose(-1, -2)  # [.., C, C] (lower triangle read)
    dV_o = A_qk.transpose(-1, -2) @ do_s  # [.., C, V]
    dS_o = q_dec.transpose(-1, -2) @ do_s  # [.., K, V]
    # reverse recurrence: S_out = a S + kt V_new, V_new = U - W S
    dS = torch.zeros_like(S_in[:, :, 0]) if dS_out is None else dS_out.to(q.dtype)
    if keep_ends and d_ends is not None:
        dS = dS + d_ends[NC]
    dVo_n, dSo_n, kd_n, a_n = dV_o.unbind(2), dS_o.unbind(2), k_to_end.unbind(2), a_end.unbind(2)
    Wt_n = W.transpose(-1, -2).unbind(2)  # [B, H, K, C]
    if start is not None:
        keep_n = (1.0 - start).unbind(0)
    dV_new = torch.empty_like(V_new)  # = dU, written by the loop
    dS_n = torch.empty_like(S_in)  # [B, H, NC, K, V] gradient of each chunk's S_out
    d_a = q.new_empty(B, H, NC, K)  # gradient of each chunk's a_end
    dV_n, dSn_n, da_n, S_in_n = dV_new.unbind(2), dS_n.unbind(2), d_a.unbind(2), S_in.unbind(2)
    d_post = [None] * NC
    for n in range(NC - 1, -1, -1):
        dSn_n[n].copy_(dS)  # written while in cache, like d_a's row sums
        torch.linalg.vecdot(S_in_n[n], dS, out=da_n[n])
        dv = dV_n[n].copy_(dVo_n[n])
        dv.view(-1, C, dv.shape[-1]).baddbmm_(_flat(kd_n[n]), _flat(dS))  # [B, H, C, V]
        dS = torch.addcmul(dSo_n[n], a_n[n], dS).sub_(Wt_n[n] @ dv)
        if start is not None:
            d_post[n] = dS[0]
            dS = dS * keep_n[n]
            if keep_ends and d_ends is not None:
                dS = dS + d_ends[n]
    ds0 = q.new_zeros(0)
    if s0 is not None:
        if start is None:
            ds0 = dS
        else:
            d_init = torch.stack(d_post) * start.view(-1, 1, 1, 1)  # [NC, H, K, V]
            ds0 = torch.zeros_like(s0).index_add_(0, chunk_doc, d_init)
    d_kd = V_new @ dS_n.transpose(-1, -2)  # [.., C, K]
    # UT transform, [W | U] = L^-1 R (L = I + beta S_kk, R = [beta exp(G) k | beta v]) with
    # dW = -dV_new S_in^T, dU = dV_new: dR = L^-T [dW | dU] gives dR_v = Ainv^T dV_new and
    # dR_k = -dR_v S_in^T; d(beta S_kk) = -(dR [W | U]^T) below the diagonal, and
    # dR [W | U]^T = dR_v (U - W S_in)^T = dR_v V_new^T.
    dRv = AinvT @ dV_new  # [.., C, V]
    dRk_e = (dRv @ S_in.transpose(-1, -2)).neg_().mul_(e_G)  # dR_k e^G: per unit beta k
    dA = (dRv @ V_new.transpose(-1, -2)).tril_(-1).neg_()  # [.., C, C] d(beta S_kk)
    d_kk = beta * dA
    dG = dRk_e * k  # also dbeta's key part
    dbeta = (torch.linalg.vecdot(dA, S_kk) + dG.sum(-1) + torch.linalg.vecdot(dRv, v)
             ).unsqueeze(-1)
    dG.mul_(beta)
    dv_in = beta * dRv
    dk = dRk_e.mul_(beta).addcmul_(d_kd, e_end)
    t_end = d_kd * k_to_end
    dG.addcmul_(d_qdec, q_dec).sub_(t_end)
    dG[..., -1, :] += t_end.sum(-2) + d_a * a_end.squeeze(-1)
    dq_i, dk_i, dG_i = intra_scores_bwd(q, k, G, d_kk, d_qk, g_min)
    dq = dq_i.addcmul_(d_qdec, e_G)
    dk += dk_i
    dG += dG_i
    dg = dG.flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g)
    return tuple(x.contiguous() for x in (dq, dk, dv_in, dg, dbeta, ds0))


@torch.library.custom_op("k3::kda_chunk", mutates_args=())
def _kda_chunk_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None,
                  start: Tensor | None, chunk_doc: Tensor | None, scale: float, keep_ends: bool,
                  g_min: float | None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor]:
    """``chunk_core`` forward: (o, ends or [0], S, W, AinvT, S_in, V_new, S_kk, A_qk)."""
    return _chunk_fwd_impl(q, k, v, g, beta, s0, start, chunk_doc, scale, keep_ends, g_min)


@_kda_chunk_op.register_fake
def _(q, k, v, g, beta, s0, start, chunk_doc, scale, keep_ends, g_min):
    B, H, NC, C, K = q.shape
    V = v.shape[-1]
    ends = q.new_empty(NC + 1, H, K, V) if keep_ends else q.new_empty(0)
    return (v.new_empty(B, H, NC, C, V), ends, q.new_empty(B, H, K, V),
            q.new_empty(B, H, NC, C, K), q.new_empty(B, H, NC, C, C), q.new_empty(B, H, NC, K, V),
            q.new_empty(B, H, NC, C, V), q.new_empty(B, H, NC, C, C),
            q.new_empty(B, H, NC, C, C))


@torch.library.custom_op("k3::kda_chunk_bwd", mutates_args=())
def _kda_chunk_bwd_op(do: Tensor, d_ends: Tensor | None, dS_out: Tensor | None, q: Tensor,
                      k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None,
                      start: Tensor | None, chunk_doc: Tensor | None, W: Tensor,
                      AinvT: Tensor, S_in: Tensor, V_new: Tensor, S_kk: Tensor, A_qk: Tensor,
                      scale: float, keep_ends: bool, g_min: float | None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``chunk_core`` backward: (dq, dk, dv, dg, dbeta, ds0 or [0])."""
    return _chunk_bwd_impl(do, d_ends, dS_out, q, k, v, g, beta, s0, start, chunk_doc, W,
                           AinvT, S_in, V_new, S_kk, A_qk, scale, keep_ends, g_min)


@_kda_chunk_bwd_op.register_fake
def _(do, d_ends, dS_out, q, k, v, g, beta, s0, start, chunk_doc, W, AinvT, S_in, V_new, S_kk,
      A_qk, scale, keep_ends, g_min):
    ds0 = q.new_empty(0) if s0 is None else torch.empty_like(s0)
    return (*(torch.empty_like(x) for x in (q, k, v, g, beta)), ds0)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, s0, start, chunk_doc, scale, keep_ends, g_min = inputs
    ctx.save_for_backward(q, k, v, g, beta, s0, start, chunk_doc, *output[3:])
    ctx.opts = (scale, keep_ends, g_min)
    ctx.mark_non_differentiable(*output[3:])


def _backward(ctx, do, d_ends, dS_out, *_residual_grads):
    q, k, v, g, beta, s0, start, chunk_doc, *residuals = ctx.saved_tensors
    scale, keep_ends, g_min = ctx.opts
    if do is None:
        do = torch.zeros_like(residuals[3])  # V_new's shape is o's
    grads = _kda_chunk_bwd_op(do, d_ends if keep_ends else None, dS_out, q, k, v, g, beta, s0,
                              start, chunk_doc, *residuals, scale, keep_ends, g_min)
    return (*grads[:5], None if s0 is None else grads[5], None, None, None, None, None)


_kda_chunk_op.register_autograd(_backward, setup_context=_setup_context)


def _flops(q_shape, v_shape, backward: bool) -> int:
    """Matrix-product FLOPs of the op: per token slot and head 6KV + 3C(K+V) forward (three
    C x K x V products: W S, K^T V' and the output's Q S; intra scores, solve, A_qk V': what
    ``train.observe.flops`` counts for KDA), 12KV + 7C(K+V) backward (no forward re-run)."""
    B, H, NC, C, K = q_shape
    V = v_shape[-1]
    per_slot = 12 * K * V + 7 * C * (K + V) if backward else 6 * K * V + 3 * C * (K + V)
    return B * H * NC * C * per_slot


@register_flop_formula(torch.ops.k3.kda_chunk)
def _(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _flops(q_shape, v_shape, backward=False)


@register_flop_formula(torch.ops.k3.kda_chunk_bwd)
def _(do_shape, d_ends_shape, dS_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
      **kwargs) -> int:
    return _flops(q_shape, v_shape, backward=True)


def chunk_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None,
               scale: float, start: Tensor | None = None, chunk_doc: Tensor | None = None,
               keep_ends: bool = False, g_min: float | None = None
               ) -> tuple[Tensor, Tensor | None, Tensor]:
    """Chunked KDA on the chunk layout: q, k, g [B, H, NC, C, K], v [B, H, NC, C, V],
    beta [B, H, NC, C, 1], one float dtype; padding tokens are all zeros (exact no-ops).

    Dense (start None): row b starts from s0[b]. Document-aligned (start [NC], 1.0 at a chunk
    where a document begins, chunk_doc [NC] long, its document, B == 1): the state entering such
    a chunk is s0[chunk_doc] (zeros without s0). Returns (o [B, H, NC, C, V], ends: with
    keep_ends, the states before each chunk's reset and after the last chunk [NC+1, H, K, V],
    else None; S the state after the last chunk [B, H, K, V]). ``g_min``: a lower bound of
    every g (K3's bounded gate; ``diag_block``), or None for any decay; a static choice, the
    result is the same to rounding."""
    xs = [x.contiguous() for x in (q, k, v, g, beta)]
    g_min = None if g_min is None else float(g_min)
    o, ends, S, *_ = _kda_chunk_op(*xs, s0, start, chunk_doc, float(scale), bool(keep_ends),
                                   g_min)
    return o, (ends if keep_ends else None), S

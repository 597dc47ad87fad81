"""KDA op: the chunked reference (and the public op on CPU) against the independent recurrence;
no host synchronisation (fake-tensor traces); the fla custom ops against fla's contract."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import model.ops.kda as kda_mod
import model.ops.kda_chunk as kda_chunk
from model.ops.backends import force_cuda_backends
from model.ops.kda import chunk_kda, chunk_kda_reference, kda_backend, recurrent_kda
from model.packing import check_cu_seqlens
from tests.helpers.fla import bind_as
from train.observe.host_syncs import HostSyncCounter

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta")


def make_inputs(
    B: int = 2, T: int = 100, H: int = 2, K: int = 16, V: int = 8, gate: str = "bounded",
    dtype: torch.dtype = F64, seed: int = 0, n_states: int | None = None,
) -> dict[str, torch.Tensor]:
    """Random KDA inputs: L2-normalised q/k, sigmoid beta, an activated gate, an initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    beta = torch.sigmoid(randn(B, T, H))
    if gate == "bounded":  # K3 lower-bounded gate, g in (-5, 0)
        g = -5.0 * torch.sigmoid(randn(B, T, H, K))
    elif gate == "strong":  # softplus gate with large exp(A_log): g down to -50 per token
        g = (-12.0 * F.softplus(2.0 * randn(B, T, H, K) + 2.0)).clamp(min=-50.0)
    else:  # unbounded Kimi-Linear gate -exp(A_log) softplus(x); exp(A_log) from 1 (mild) to 16
        a_log = torch.linspace(0.0, 16.0, H, dtype=F64).clamp(min=1.0).log().view(1, 1, H, 1)
        g = (-a_log.exp() * F.softplus(3.0 * randn(B, T, H, K) - 1.0)).clamp(min=-30.0)
    s0 = randn(B if n_states is None else n_states, H, K, V)
    out = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0}
    return {n: x.to(dtype) for n, x in out.items()}


def run(fn, inp: dict[str, torch.Tensor], **kw):
    return fn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
              initial_state=inp["initial_state"], output_final_state=True, **kw)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_recurrence_matches_householder_form() -> None:
    """The oracle vs the other form of §1.1: S_t = (I - b k k^T) Diag(a) S + b k v^T."""
    inp = make_inputs(B=2, T=5, H=2, K=4, V=3, seed=5)
    o, s = run(recurrent_kda, inp)  # default scale must be K**-0.5
    eye = torch.eye(4, dtype=F64)
    for bi in range(2):
        for h in range(2):
            S = inp["initial_state"][bi, h]
            for t in range(5):
                kt, bt = inp["k"][bi, t, h], inp["beta"][bi, t, h]
                S = ((eye - bt * torch.outer(kt, kt)) @ torch.diag(inp["g"][bi, t, h].exp()) @ S
                     + bt * torch.outer(kt, inp["v"][bi, t, h]))
                assert max_err(o[bi, t, h], 0.5 * S.T @ inp["q"][bi, t, h]) <= 1e-12
            assert max_err(s[bi, h], S) <= 1e-12


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_chunk_matches_recurrence_fp64(gate: str, chunk_size: int) -> None:
    inp = make_inputs(gate=gate)  # T=100: not a multiple of either chunk size
    o_ref, s_ref = run(recurrent_kda, inp)
    o, s = run(chunk_kda_reference, inp, chunk_size=chunk_size)
    assert o.dtype == F64 and s.dtype == F64 and o.shape == (2, 100, 2, 8)
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(s, s_ref) <= 1e-10
    assert o_ref.abs().max() > 0.1 and s_ref.abs().max() > 0.1  # not a trivially small problem


def test_chunk_without_initial_state_fp64() -> None:
    inp = make_inputs(T=77)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    o_ref, _ = recurrent_kda(*args)
    o, s = chunk_kda_reference(*args, chunk_size=32)
    assert s is None
    assert max_err(o, o_ref) <= 1e-10


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_chunk_fp32_matches_fp64_recurrence(gate: str, chunk_size: int) -> None:
    inp64 = make_inputs(gate=gate)
    o_ref, s_ref = run(recurrent_kda, inp64)
    inp32 = {n: x.float() for n, x in inp64.items()}
    o, s = run(chunk_kda_reference, inp32, chunk_size=chunk_size)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert max_err(o, o_ref) <= 1e-4
    assert max_err(s, s_ref) <= 1e-4


def test_unbounded_gate_no_overflow_and_finite_grads() -> None:
    inp = {n: x.float().requires_grad_() for n, x in make_inputs(gate="unbounded").items()}
    G = inp["g"].detach()[:, :64].sum(dim=1)  # total log-decay over the first 64-token chunk
    assert G.min() < -709.0  # exp(-G) would overflow even in float64: masking must come first
    o, s = run(chunk_kda_reference, inp, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    (o.square().sum() + s.square().sum()).backward()
    for name, x in inp.items():
        assert torch.isfinite(x.grad).all(), name


def test_low_precision_inputs_keep_fp32_state() -> None:
    inp = {n: x.bfloat16() if n != "initial_state" else x.float()
           for n, x in make_inputs(T=40).items()}
    o, s = run(chunk_kda_reference, inp, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, s_ref = run(recurrent_kda, {n: x.double() for n, x in inp.items()})
    assert max_err(s, s_ref) <= 1e-4  # computed in fp32 from bf16-representable inputs


@pytest.mark.parametrize("lengths", [[37, 1, 64, 50], [5, 0, 20]])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_varlen_matches_per_sequence_recurrence(lengths: list[int], chunk_size: int) -> None:
    N, T = len(lengths), sum(lengths)
    inp = make_inputs(B=1, T=T, n_states=N, seed=1)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    o, s = run(chunk_kda_reference, inp, cu_seqlens=cu, chunk_size=chunk_size)
    o_rec, s_rec = run(recurrent_kda, inp, cu_seqlens=cu)  # recurrence with per-sequence resets
    assert o.shape == (1, T, 2, 8) and s.shape == (N, 2, 16, 8)
    for i in range(N):  # each sequence on its own, with its own initial state
        a, b = int(cu[i]), int(cu[i + 1])
        one = {n: x[:, a:b] for n, x in inp.items() if n != "initial_state"}
        one["initial_state"] = inp["initial_state"][i : i + 1]
        o_i, s_i = run(recurrent_kda, one)
        if b > a:
            assert max_err(o[:, a:b], o_i) <= 1e-10
            assert max_err(o_rec[:, a:b], o_i) <= 1e-10
        assert max_err(s[i : i + 1], s_i) <= 1e-10
        assert max_err(s_rec[i : i + 1], s_i) <= 1e-10
    # Packing without resets would differ: the boundaries must matter in this test.
    o_noreset, _ = run(recurrent_kda, {**inp, "initial_state": inp["initial_state"][:1]})
    assert max_err(o, o_noreset) > 1e-3


def test_varlen_rejects_bad_shapes() -> None:
    """Shapes are checked; cu_seqlens values are not (that would read them on the host): the
    caller validates its host copy with `check_cu_seqlens`."""
    inp = make_inputs(B=2, T=10)
    with pytest.raises(ValueError):
        run(chunk_kda_reference, inp, cu_seqlens=torch.tensor([0, 4, 10]))  # B must be 1
    inp = make_inputs(B=1, T=10, n_states=2)
    with pytest.raises(ValueError):
        run(chunk_kda_reference, inp, cu_seqlens=torch.tensor([0, 3, 6, 10]))  # 3 != 2 states
    with pytest.raises(ValueError):
        run(chunk_kda_reference, inp, cu_seqlens=torch.tensor([0.0, 4.0, 10.0]))  # not integer
    with pytest.raises(ValueError):
        check_cu_seqlens(torch.tensor([0, 4, 9]), 1, 10)  # does not end at T: the caller's check


def test_gradcheck_chunk_reference() -> None:
    inp = {n: x.requires_grad_() for n, x in make_inputs(B=1, T=7, H=1, K=3, V=3).items()}

    def fn(q, k, v, g, beta, s0):
        return chunk_kda_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                   chunk_size=4)

    assert torch.autograd.gradcheck(fn, tuple(inp.values()))


def test_gradcheck_chunk_reference_varlen() -> None:
    inp = {n: x.requires_grad_() for n, x in make_inputs(B=1, T=7, H=1, K=3, V=3,
                                                         n_states=2).items()}
    cu = torch.tensor([0, 3, 7])

    def fn(q, k, v, g, beta, s0):
        return chunk_kda_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                   cu_seqlens=cu, chunk_size=2)

    assert torch.autograd.gradcheck(fn, tuple(inp.values()))


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_chunk_gradients_match_recurrence(gate: str) -> None:
    base = make_inputs(B=2, T=45, H=2, K=8, V=6, gate=gate, seed=3)
    gen = torch.Generator().manual_seed(4)
    w_o = torch.randn(2, 45, 2, 6, generator=gen, dtype=F64)
    w_s = torch.randn(2, 2, 8, 6, generator=gen, dtype=F64)
    grads = []
    for fn, kw in ((recurrent_kda, {}), (chunk_kda_reference, {"chunk_size": 16})):
        inp = {n: x.clone().requires_grad_() for n, x in base.items()}
        o, s = run(fn, inp, **kw)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads.append({n: x.grad for n, x in inp.items()})
    for name in base:
        assert grads[0][name].abs().max() > 1e-3, name  # gradient actually flows
        assert max_err(grads[1][name], grads[0][name]) <= 1e-9, name


def test_backend_is_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    assert kda_backend(torch.device("cpu")) == "torch"
    inp = make_inputs(T=70)
    o, s = run(chunk_kda, inp)
    o_ref, s_ref = run(recurrent_kda, inp)
    assert max_err(o, o_ref) <= 1e-10 and max_err(s, s_ref) <= 1e-10
    args = [inp[n].float() for n in ("q", "k", "v", "g", "beta")]
    assert chunk_kda(*args)[1] is None


def test_backend_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kda_mod, "_load_fla", lambda: object())  # pretend fla is importable
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    assert kda_backend(torch.device("cuda")) == "fla"
    assert kda_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    assert kda_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    with pytest.raises(RuntimeError):
        kda_backend("cpu")
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    with pytest.raises(ValueError):
        kda_backend("cpu")


def test_forced_cuda_backends_pick_fla_without_import(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_import():
        raise AssertionError("kda_backend must not import fla when the CUDA backends are forced")

    monkeypatch.setattr(kda_mod, "_load_fla", no_import)
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    with force_cuda_backends():
        assert kda_backend("cpu") == "fla"
    assert kda_backend("cpu") == "torch"


# ------------------------------------------------------ intra-chunk scores: exact for any decay
@pytest.mark.parametrize("C", [1, 3, 16, 20, 64])
def test_intra_scores_exact_for_strong_decays(C: int) -> None:
    """The dyadic factored scores equal the direct masked formula, for chunk sizes that are and
    are not powers of two, with decays far beyond exp's range (the direct form masks first)."""
    inp = make_inputs(B=1, T=2 * C, H=2, K=8, gate="strong", seed=7)
    q, k, g = (inp[n].reshape(1, 2, C, 2, 8).permute(0, 3, 1, 2, 4) for n in ("q", "k", "g"))
    G = g.cumsum(-2)  # [1, H, 2, C, K]
    span = (G[..., 0, :] - G[..., -1, :]).max()  # exp(span / 2) overflows fp32 / fp64
    assert C < 16 or span > (2 * 709 if C == 64 else 2 * 88)
    S_kk, S_qk = kda_chunk.intra_scores(q, k, G)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [.., C(r), C(i), K]
    decay = torch.where(causal.unsqueeze(-1), diff, -torch.inf).exp()
    g32 = g.float().requires_grad_()  # fp32: no overflow either, padding tokens included
    S32 = kda_chunk.intra_scores(q.float(), k.float(), g32.cumsum(-2))
    (S32[0].sum() + S32[1].sum() + 0 * g32.sum()).backward()
    assert torch.isfinite(g32.grad).all()
    for x, got, got32 in ((k, S_kk, S32[0]), (q, S_qk, S32[1])):
        want = torch.einsum("bhnrk,bhnrik,bhnik->bhnri", x, decay, k)
        assert got.shape == want.shape and max_err(got, want) <= 1e-12
        assert max_err(got32, want) <= 1e-4


@pytest.mark.parametrize("C", [3, 16, 64])
def test_intra_scores_backward_matches_direct_formula(C: int) -> None:
    """The hand-written backward of the dyadic scores vs autograd of the direct masked formula
    (float64, strong decays); entries above the diagonal of the incoming gradients are ignored."""
    inp = make_inputs(B=1, T=2 * C, H=2, K=8, gate="strong", seed=8)
    q, k, g = (inp[n].reshape(1, 2, C, 2, 8).permute(0, 3, 1, 2, 4) for n in ("q", "k", "g"))
    G = g.cumsum(-2)
    gen = torch.Generator().manual_seed(9)
    w_kk, w_qk = (torch.randn(1, 2, 2, C, C, generator=gen, dtype=F64) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, G)]
    ql, kl, Gl = leaves
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    diff = Gl.unsqueeze(-2) - Gl.unsqueeze(-3)  # [.., C(r), C(i), K]
    decay = torch.where(causal.unsqueeze(-1), diff, -torch.inf).exp()
    s_kk = torch.einsum("bhnrk,bhnrik,bhnik->bhnri", kl, decay, kl)
    s_qk = torch.einsum("bhnrk,bhnrik,bhnik->bhnri", ql, decay, kl)
    ((s_kk * w_kk.tril()).sum() + (s_qk * w_qk.tril()).sum()).backward()
    got = kda_chunk.intra_scores_bwd(q, k, G, w_kk, w_qk)
    for name, mine, want in zip("qkG", got, (x.grad for x in leaves)):
        assert want.abs().max() > 1e-3, name
        assert max_err(mine, want) <= 1e-10, name


def test_diag_block_is_static_and_bounded() -> None:
    """The bounded gate's diagonal block: largest power of two with |g_min| S <= log(max) / 2."""
    f32, f64 = torch.float32, F64
    assert kda_chunk.diag_block(None, 64, f32) == 1
    assert kda_chunk.diag_block(-5.0, 64, f32) == 8  # 40 <= 44.4 < 80
    assert kda_chunk.diag_block(-5.0, 4, f32) == 4
    assert kda_chunk.diag_block(-5.0, 64, f64) == 64  # 320 <= 354.9
    assert kda_chunk.diag_block(-20.0, 64, f64) == 16
    assert kda_chunk.diag_block(-50.0, 64, f32) == 1


BOUNDED_CASES = {"fp32_C64": (64, torch.float32, -5.0), "fp32_C20": (20, torch.float32, -5.0),
                 "fp64_C64": (64, F64, -20.0), "fp64_C16": (16, F64, -5.0),
                 "fp32_C3": (3, torch.float32, -5.0)}


@pytest.mark.parametrize("case", list(BOUNDED_CASES))
def test_intra_scores_bounded_gate_matches_direct_formula(case: str) -> None:
    """With g_min (larger diagonal blocks, ``diag_block``) the scores and their backward equal
    the direct masked formula in float64 (autograd for the backward), g spanning [g_min, 0]
    with a quarter of the tokens exactly at the bound (the largest factors)."""
    C, dtype, g_min = BOUNDED_CASES[case]
    gen = torch.Generator().manual_seed(11)
    q, k = (F.normalize(torch.randn(1, 2, 3, C, 8, generator=gen, dtype=F64), dim=-1)
            for _ in range(2))
    g = g_min * torch.rand(1, 2, 3, C, 8, generator=gen, dtype=F64)
    g = torch.where(torch.rand(g.shape, generator=gen, dtype=F64) < 0.25, g_min, g)
    w_kk, w_qk = (torch.randn(1, 2, 3, C, C, generator=gen, dtype=F64) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, g.cumsum(-2))]
    ql, kl, Gl = leaves
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = torch.where(causal.unsqueeze(-1), Gl.unsqueeze(-2) - Gl.unsqueeze(-3), -torch.inf).exp()
    want = [torch.einsum("bhnrk,bhnrik,bhnik->bhnri", x, decay, kl) for x in (kl, ql)]
    ((want[0] * w_kk.tril()).sum() + (want[1] * w_qk.tril()).sum()).backward()
    args = [x.detach().to(dtype) for x in leaves]
    got = kda_chunk.intra_scores(*args, g_min=g_min)
    got_bwd = kda_chunk.intra_scores_bwd(*args, w_kk.to(dtype), w_qk.to(dtype), g_min=g_min)
    assert kda_chunk.diag_block(g_min, 1 << (C - 1).bit_length(), dtype) > 1
    tol, gtol = (1e-12, 1e-10) if dtype == F64 else (1e-5, 1e-4)  # fp32: G rounds to 1e-5
    for mine, ref in zip(got, want):
        assert mine.shape == ref.shape and max_err(mine, ref.detach()) <= tol
    for name, mine, ref in zip("qkG", got_bwd, (x.grad for x in leaves)):
        assert ref.abs().max() > 1e-3, name
        assert torch.isfinite(mine).all() and max_err(mine, ref) <= gtol, name


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_bounded_gate_chunk_matches_recurrence(packed: bool, dtype: torch.dtype) -> None:
    """The chunked reference with ``g_lower_bound`` (K3's -5) vs the token recurrence: outputs,
    final states and every input's gradient (dense and document-packed)."""
    lengths = [37, 64, 27]
    T = sum(lengths)
    base = make_inputs(B=1 if packed else 2, T=T, H=2, K=16, V=8, seed=12,
                       n_states=len(lengths) if packed else None)
    kw = {"cu_seqlens": torch.tensor([0, 37, 101, 128])} if packed else {}
    gen = torch.Generator().manual_seed(13)
    w_o = torch.randn(*base["v"].shape, generator=gen, dtype=F64)
    w_s = torch.randn(*base["initial_state"].shape, generator=gen, dtype=F64)
    res = []
    for fn, extra, dt in ((recurrent_kda, {}, F64),
                          (chunk_kda_reference, {"chunk_size": 64, "g_lower_bound": -5.0}, dtype)):
        inp = {n: x.detach().to(dt).requires_grad_() for n, x in base.items()}
        o, s = run(fn, inp, **kw, **extra)
        ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
        res.append((o, s, {n: x.grad for n, x in inp.items()}))
    tol = 1e-10 if dtype == F64 else 1e-4
    assert max_err(res[1][0], res[0][0]) <= tol and max_err(res[1][1], res[0][1]) <= tol
    for name in base:
        assert res[0][2][name].abs().max() > 1e-3, name
        assert max_err(res[1][2][name], res[0][2][name]) <= 10 * tol, name


@pytest.mark.parametrize("g_min", [None, -1.0])
@pytest.mark.parametrize("packed", [False, True])
def test_kda_chunk_custom_op_contract(packed: bool, g_min: float | None) -> None:
    """torch.library.opcheck: schema, fake implementation, autograd registration, AOT dispatch."""
    gen = torch.Generator().manual_seed(1)
    B, H, NC, C, K, V = (1 if packed else 2), 2, 3, 4, 4, 3
    q, k = (F.normalize(torch.randn(B, H, NC, C, K, generator=gen, dtype=F64), dim=-1)
            for _ in range(2))
    v = torch.randn(B, H, NC, C, V, generator=gen, dtype=F64)
    g = -torch.rand(B, H, NC, C, K, generator=gen, dtype=F64)
    beta = torch.rand(B, H, NC, C, 1, generator=gen, dtype=F64)
    s0 = torch.randn(2 if packed else B, H, K, V, generator=gen, dtype=F64)
    start = torch.tensor([1.0, 0.0, 1.0], dtype=F64) if packed else None
    chunk_doc = torch.tensor([0, 0, 1]) if packed else None
    args = [x.requires_grad_() for x in (q, k, v, g, beta, s0)]
    torch.library.opcheck(torch.ops.k3.kda_chunk.default,
                          (*args, start, chunk_doc, 0.5, packed, g_min))
    outs = torch.ops.k3.kda_chunk(*(x.detach() for x in args), start, chunk_doc, 0.5, packed,
                                  g_min)
    d_ends = torch.randn_like(outs[1]) if packed else None
    torch.library.opcheck(torch.ops.k3.kda_chunk_bwd.default,
                          (torch.randn_like(outs[0]), d_ends, torch.randn_like(outs[2]),
                           *(x.detach() for x in args), start, chunk_doc, *outs[3:], 0.5, packed,
                           g_min))


def test_kda_chunk_flops_match_the_trainers_count() -> None:
    """FlopCounterMode sees the custom op's formula: forward = train.observe.flops' KDA forward
    count (T a multiple of the chunk), backward 12KV + 7C(K+V) per token and head."""
    from types import SimpleNamespace

    from torch.utils.flop_counter import FlopCounterMode

    from train.observe.flops import kda_flops_per_token

    T, H, D, C = 64, 2, 8, 16
    inp = {n: x.float().requires_grad_() for n, x in make_inputs(B=1, T=T, H=H, K=D, V=D).items()}
    with FlopCounterMode(display=False) as fc:
        o, s = run(chunk_kda_reference, inp, chunk_size=C)
    cfg = SimpleNamespace(kda_head_dim=D, kda_chunk_size=C, kda_num_heads=H)
    assert fc.get_total_flops() == T * kda_flops_per_token(cfg, T) / 3
    with FlopCounterMode(display=False) as fc:
        (o.sum() + s.sum()).backward()
    assert fc.get_total_flops() == T * H * (12 * D * D + 7 * C * 2 * D)


# --------------------------------------------------------- varlen: document-aligned chunk layout
VARLEN_CASES = {
    "edges": [1, 63, 64, 65, 130],  # around one chunk of 64, and a long document
    "empty_mid_and_tail": [5, 0, 70, 0, 1, 0, 0],  # trailing repeats of T, as pipelines pass
    "empty_first": [0, 0, 40],
}


def per_document(inp: dict[str, torch.Tensor], cu: torch.Tensor, with_state: bool = True):
    """Each document alone through the (unpacked) recurrence: (o [1, T, H, V], S [N, H, K, V])."""
    outs, states = [], []
    for i in range(cu.numel() - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        s0 = inp["initial_state"][i : i + 1] if with_state else None
        o_i, s_i = recurrent_kda(*(inp[n][:, a:b] for n in NAMES), initial_state=s0,
                                 output_final_state=True)
        outs.append(o_i)
        states.append(s_i)
    return torch.cat(outs, dim=1), torch.cat(states)


def packed_inputs(lengths: list[int], seed: int = 1, **kw) -> tuple[dict, torch.Tensor]:
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return make_inputs(B=1, T=sum(lengths), n_states=len(lengths), seed=seed, **kw), cu


@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_document_aligned_matches_each_document(case: str, chunk_size: int) -> None:
    inp, cu = packed_inputs(VARLEN_CASES[case])
    o_ref, s_ref = per_document(inp, cu)
    o, s = run(chunk_kda_reference, inp, cu_seqlens=cu, chunk_size=chunk_size)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert max_err(o, o_ref) <= 1e-10 and max_err(s, s_ref) <= 1e-10
    empty = [i for i, n in enumerate(VARLEN_CASES[case]) if n == 0]
    assert torch.equal(s[empty], inp["initial_state"][empty])  # empty: final = initial state
    if chunk_size == 64:  # the packed recurrence (the oracle's varlen path) agrees too
        o_rec, s_rec = run(recurrent_kda, inp, cu_seqlens=cu)
        assert max_err(o_rec, o_ref) <= 1e-10 and max_err(s_rec, s_ref) <= 1e-10


def test_varlen_without_initial_state_empty_documents_end_at_zero() -> None:
    inp, cu = packed_inputs(VARLEN_CASES["empty_mid_and_tail"])
    args = [inp[n] for n in NAMES]
    o, s = chunk_kda_reference(*args, output_final_state=True, cu_seqlens=cu, chunk_size=32)
    o_ref, s_ref = per_document(inp, cu, with_state=False)
    assert max_err(o, o_ref) <= 1e-10 and max_err(s, s_ref) <= 1e-10
    assert s[[1, 3, 5, 6]].abs().max() == 0 and s[[0, 2, 4]].abs().min() > 0


@pytest.mark.parametrize("chunk_size", [3, 8])  # 3: intra-chunk padding to a power of two
def test_varlen_gradients_match_each_document_fp64(chunk_size: int) -> None:
    lengths = [3, 0, 21, 1, 9, 0]
    inp, cu = packed_inputs(lengths, seed=2, H=1, K=4, V=3)
    gen = torch.Generator().manual_seed(5)
    w_o = torch.randn(1, sum(lengths), 1, 3, generator=gen, dtype=F64)
    w_s = torch.randn(len(lengths), 1, 4, 3, generator=gen, dtype=F64)
    grads = []
    for fn in (lambda x: per_document(x, cu),
               lambda x: run(chunk_kda_reference, x, cu_seqlens=cu, chunk_size=chunk_size)):
        leaves = {n: x.clone().requires_grad_() for n, x in inp.items()}
        o, s = fn(leaves)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads.append({n: x.grad for n, x in leaves.items()})
    for name in inp:
        assert grads[0][name].abs().max() > 1e-3, name
        assert max_err(grads[1][name], grads[0][name]) <= 1e-10, name


@pytest.mark.parametrize("packed", [False, True])
def test_strong_decays_values_and_gradients_fp64(packed: bool) -> None:
    """g down to -50 per token: exp of a chunk's decay span overflows even float64."""
    if packed:
        inp, cu = packed_inputs([37, 0, 70], seed=3, H=2, K=8, V=4, gate="strong")
        kw: dict = {"cu_seqlens": cu}
    else:
        inp, kw = make_inputs(B=2, T=70, H=2, K=8, V=4, gate="strong", seed=3), {}
    assert inp["g"][:, :64].sum(1).min() < -2 * 709
    outs, grads = [], []
    for fn, extra in ((recurrent_kda, {}), (chunk_kda_reference, {"chunk_size": 64})):
        leaves = {n: x.clone().requires_grad_() for n, x in inp.items()}
        o, s = run(fn, leaves, **kw, **extra)
        (o.square().sum() + s.sum()).backward()
        outs.append((o, s))
        grads.append({n: x.grad for n, x in leaves.items()})
    assert max_err(outs[1][0], outs[0][0]) <= 1e-10 and max_err(outs[1][1], outs[0][1]) <= 1e-10
    for name in inp:
        assert torch.isfinite(grads[1][name]).all(), name
        assert max_err(grads[1][name], grads[0][name]) <= 1e-9, name


def test_strong_decays_fp32_close_to_fp64_recurrence() -> None:
    inp = make_inputs(B=1, T=130, H=2, K=16, V=8, gate="strong", seed=4)
    o_ref, s_ref = run(recurrent_kda, inp)
    o, s = run(chunk_kda_reference, {n: x.float() for n, x in inp.items()}, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert max_err(o, o_ref) <= 1e-4 and max_err(s, s_ref) <= 1e-4


# ------------------------------------------------------------------- no host synchronisation
def _fake_inputs(lengths: list[int], H: int = 2, K: int = 16, V: int = 8):
    """Inside FakeTensorMode: packed CPU inputs with requires_grad, an initial state, cu."""
    T, N = sum(lengths), len(lengths)
    q, k = (F.normalize(torch.randn(1, T, H, K), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, H, V, requires_grad=True)
    g = (-5.0 * torch.sigmoid(torch.randn(1, T, H, K))).requires_grad_()
    beta = torch.rand(1, T, H, requires_grad=True)
    s0 = torch.randn(N, H, K, V, requires_grad=True)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return (q, k, v, g, beta, s0), cu


@pytest.mark.parametrize("path", ["reference", "fla_custom_op"])
def test_traces_under_fake_tensors(path: str) -> None:
    """Any host read raises DataDependentOutputException / DynamicOutputShapeException here."""
    lengths = [5, 0, 70, 1, 0, 0]
    with FakeTensorMode():
        (q, k, v, g, beta, s0), cu = _fake_inputs(lengths)
        if path == "reference":
            o, s = chunk_kda_reference(q, k, v, g, beta, initial_state=s0,
                                       output_final_state=True, cu_seqlens=cu, chunk_size=16)
        else:  # the custom ops' fake implementations stand in for fla
            with force_cuda_backends():
                o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                 cu_seqlens=cu, chunk_size=64, cu_seqlens_cpu=cu)
        (o.sum() + s.sum()).backward()
        grads = [x.grad for x in (q, k, v, g, beta, s0)]
    assert o.shape == (1, 76, 2, 8) and s.shape == (6, 2, 16, 8) and s.dtype == torch.float32
    assert all(gr is not None and gr.shape == x.shape
               for gr, x in zip(grads, (q, k, v, g, beta, s0)))


def test_reference_reads_nothing_on_the_host() -> None:
    inp, cu = packed_inputs([5, 0, 40, 1, 0], H=1, K=4, V=3)
    leaves = {n: x.float().requires_grad_() for n, x in inp.items()}
    with HostSyncCounter() as counter:
        o, s = run(chunk_kda_reference, leaves, cu_seqlens=cu, chunk_size=16)
        (o.sum() + s.sum()).backward()
    assert counter.counts == {}, counter.counts


# -------------------------------------------------------- fla custom ops against fla's contract
def _fla_0_6(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
             lower_bound=None, disable_recompute=False, return_intermediate_states=False,
             state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
             use_graph=False, max_num_seqs=None, **kwargs):
    """Signature of fla-core 0.6.0's chunk_kda (chunk_size is read from **kwargs)."""


def _fla_0_4_0(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Signature of fla 0.4.0's chunk_kda (no cu_seqlens_cpu; chunk size fixed at 64)."""


def make_fla_stand_in(signature_of, calls: list[dict]):
    """A stand-in for fla's chunk_kda: checks each call against fla's contract, records it, and
    computes the result with the reference (so the custom ops' real paths run on CPU)."""
    sig = inspect.signature(signature_of)

    def stand_in(*args, **kwargs):
        a, extra = bind_as(sig, args, kwargs)  # raises on an argument fla does not take
        q, v, cu, h0 = a["q"], a["v"], a["cu_seqlens"], a["initial_state"]
        assert set(extra) <= {"chunk_size"}, extra
        assert extra.get("chunk_size", 64) in (32, 64)
        assert not any(a[n] for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                      "use_beta_sigmoid_in_kernel", "safe_gate") if n in a)
        assert isinstance(a["scale"], float)
        if cu is not None:
            assert q.shape[0] == 1 and cu.dtype == torch.int32 and cu.device == q.device
            assert h0 is None or h0.shape[0] == cu.numel() - 1
        if a.get("cu_seqlens_cpu") is not None:
            assert a["cu_seqlens_cpu"].device.type == "cpu"
            assert torch.equal(a["cu_seqlens_cpu"].long(), cu.long())
        assert h0 is None or h0.dtype == torch.float32
        calls.append({"kwargs": sorted(kwargs), "chunk_size": extra.get("chunk_size"),
                      "grad": torch.is_grad_enabled() and q.requires_grad})
        o, ht = chunk_kda_reference(*(a[n] for n in NAMES), scale=a["scale"], initial_state=h0,
                                    output_final_state=a["output_final_state"], cu_seqlens=cu,
                                    chunk_size=extra.get("chunk_size", 64))
        return o.to(v.dtype), ht

    stand_in.__signature__ = sig  # what inspect.signature (our feature test) sees
    return stand_in


@pytest.mark.parametrize("version", ["0.6.0", "0.4.0"])
@pytest.mark.parametrize("packed", [True, False])
def test_fla_custom_ops_call_fla_by_its_contract(monkeypatch: pytest.MonkeyPatch, version: str,
                                                 packed: bool) -> None:
    """Forward and backward through k3::chunk_kda_fla(_bwd) on CPU with a stand-in for fla:
    arguments as fla takes them, results and gradients those of the reference."""
    calls: list[dict] = []
    sig_of = {"0.6.0": _fla_0_6, "0.4.0": _fla_0_4_0}[version]
    stand_in = make_fla_stand_in(sig_of, calls)
    monkeypatch.setattr(kda_mod, "_load_fla", lambda: stand_in)
    monkeypatch.setattr(kda_mod, "_fla_version", lambda: tuple(map(int, version.split("."))))
    if packed:
        base, cu = packed_inputs([5, 0, 40, 20, 0], H=2, K=8, V=4)
        kw: dict = {"cu_seqlens": cu.long(), "cu_seqlens_cpu": cu}  # int32 is what fla gets
    else:
        base, kw = make_inputs(B=2, T=45, H=2, K=8, V=4), {}
    base = {n: x.float() for n, x in base.items()}
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(base["v"].shape, generator=gen)
    results = []
    for forced in (True, False):  # the custom ops, then the reference itself
        leaves = {n: x.clone().requires_grad_() for n, x in base.items()}
        with force_cuda_backends(forced):
            o, s = run(chunk_kda, leaves, chunk_size=32, scale=0.3, **kw)
        ((o * w).sum() + s.square().sum()).backward()
        results.append((o, s, {n: x.grad for n, x in leaves.items()}))
    (o1, s1, g1), (o2, s2, g2) = results
    assert o1.dtype == torch.float32 and s1.dtype == torch.float32
    assert max_err(o1, o2) <= 1e-6 and max_err(s1, s2) <= 1e-6
    for n in base:
        assert max_err(g1[n], g2[n]) <= 1e-5, n
    assert [c["grad"] for c in calls] == [False, True]  # forward, then backward's recompute
    want = ["cu_seqlens", "initial_state", "output_final_state", "scale"]
    if version == "0.6.0":
        want = sorted([*want, "chunk_size"] + (["cu_seqlens_cpu"] if packed else []))
    assert all(c["kwargs"] == want for c in calls), calls


def test_fla_custom_op_without_final_state_and_unsupported_chunk(monkeypatch) -> None:
    """No initial state, no final state, chunk 16 (fla takes 32 or 64 only: fla's own 64)."""
    calls: list[dict] = []
    stand_in = make_fla_stand_in(_fla_0_6, calls)
    monkeypatch.setattr(kda_mod, "_load_fla", lambda: stand_in)
    monkeypatch.setattr(kda_mod, "_fla_version", lambda: (0, 6, 0))
    base = {n: x.float() for n, x in make_inputs(B=2, T=20, H=1, K=4, V=4).items()}
    leaves = [base[n].clone().requires_grad_() for n in NAMES]
    with force_cuda_backends():
        o, s = chunk_kda(*leaves, chunk_size=16)
    assert s is None
    o.sum().backward()
    o_ref, _ = chunk_kda_reference(*(base[n] for n in NAMES))
    assert max_err(o, o_ref) <= 1e-6 and all(x.grad is not None for x in leaves)
    assert [c["chunk_size"] for c in calls] == [None, None]


@pytest.mark.parametrize("gate", ["bounded", "strong"])
def test_no_future_token_leakage(gate: str) -> None:
    """Outputs of tokens < t are bitwise independent of the inputs at t and after (the anchors
    of the intra-chunk factors never look past the row's token; a chunk-midpoint anchor would
    let future gates leak in through rounding)."""
    inp = {n: x.float() for n, x in make_inputs(B=1, T=64, gate=gate, seed=8).items()}
    later = make_inputs(B=1, T=64, gate=gate, seed=9)
    changed = {n: torch.cat([x[:, :40], later[n][:, 40:].float()], dim=1)
               for n, x in inp.items() if n != "initial_state"}
    changed["initial_state"] = inp["initial_state"]
    o1, _ = run(chunk_kda_reference, inp, chunk_size=64)
    o2, _ = run(chunk_kda_reference, changed, chunk_size=64)
    assert torch.equal(o1[:, :40], o2[:, :40]) and not torch.equal(o1[:, 40:], o2[:, 40:])

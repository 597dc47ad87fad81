"""KDA op: the chunked reference (and the public op on CPU) against the independent recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import model.ops.kda as kda_mod
from model.ops.kda import chunk_kda, chunk_kda_reference, kda_backend, recurrent_kda

F64 = torch.float64


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


def test_varlen_rejects_bad_inputs() -> None:
    inp = make_inputs(B=2, T=10)
    with pytest.raises(ValueError):
        run(chunk_kda_reference, inp, cu_seqlens=torch.tensor([0, 4, 10]))  # B must be 1
    inp = make_inputs(B=1, T=10, n_states=2)
    with pytest.raises(ValueError):
        run(chunk_kda_reference, inp, cu_seqlens=torch.tensor([0, 4, 9]))  # does not end at T


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


def test_fla_dispatch_forwards_plain_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_fla(*args, **kwargs):
        calls.append((args, kwargs))
        return "o", "s"

    monkeypatch.setattr(kda_mod, "_load_fla", lambda: fake_fla)
    monkeypatch.setattr(kda_mod, "kda_backend", lambda device: "fla")
    inp = make_inputs(B=1, T=5, n_states=2)
    cu = torch.tensor([0, 2, 5])
    assert run(chunk_kda, inp, cu_seqlens=cu, scale=0.3) == ("o", "s")
    (args, kwargs), = calls
    assert all(a is inp[n] for a, n in zip(args, ("q", "k", "v", "g", "beta"), strict=True))
    assert sorted(kwargs) == ["cu_seqlens", "initial_state", "output_final_state", "scale"]
    assert kwargs["scale"] == 0.3 and kwargs["output_final_state"] is True
    assert kwargs["initial_state"] is inp["initial_state"] and kwargs["cu_seqlens"] is cu


@pytest.mark.parametrize("path", ["factored", "broadcast"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_both_intra_chunk_paths_match_recurrence(monkeypatch: pytest.MonkeyPatch, path: str,
                                                 dtype: torch.dtype) -> None:
    """The factored matmul form (bounded decay span) and the broadcast form agree with the
    recurrence, values and gradients; the span threshold decides which one runs."""
    limit = {F64: 1e9, torch.float32: 1e9} if path == "factored" else {}
    monkeypatch.setattr(kda_mod, "_FACTOR_SPAN", limit)
    calls = []
    real = kda_mod._intra_scores_factored
    monkeypatch.setattr(kda_mod, "_intra_scores_factored",
                        lambda *a: calls.append(1) or real(*a))
    inp = make_inputs(T=50, gate="bounded", seed=3)  # g in (-5, 0): span <= 80 per 16 tokens
    ref = {n: x.clone().requires_grad_() for n, x in inp.items()}
    got = {n: x.to(dtype).detach().requires_grad_() for n, x in inp.items()}
    o_ref, s_ref = run(recurrent_kda, ref)
    o, s = run(chunk_kda_reference, got, chunk_size=16)
    assert bool(calls) == (path == "factored")
    tol = 1e-10 if dtype == F64 else 1e-4
    assert max_err(o, o_ref) <= tol and max_err(s, s_ref) <= tol
    (o_ref.sum() + s_ref.sum()).backward()
    (o.double().sum() + s.double().sum()).backward()
    for n in ref:
        assert max_err(got[n].grad, ref[n].grad) <= tol * 10, n

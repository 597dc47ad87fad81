"""KDA's prologue inside fla's kernel (`chunk_kda(gate=)` -> `k3::chunk_kda_fla` with
`gate_in_kernel`), proven on CPU by argument capture.

fla's kernels do not run on CPU, its references do. A stand-in for fla's `chunk_kda` binds each
call to the real signature of the installed fla-core (a dev dependency), checks the prologue
flags (`use_qk_l2norm_in_kernel`, `use_gate_in_kernel` with `A_log` / `dt_bias`,
`use_beta_sigmoid_in_kernel`, `safe_gate` + `lower_bound`), layouts and dtypes, and computes
what fla documents for those flags with fla's own references (`naive_kda_lowerbound_gate`,
`naive_kda_gate`, `naive_recurrent_kda` per document, fla's l2norm formula). The custom ops'
real forward and backward then run around it, and their results and gradients (A_log and
dt_bias included) must equal our CPU path (`kda_prologue` + `chunk_kda_reference`).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from fla.ops.kda import chunk_kda as fla_chunk_kda
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda

import model.ops.kda as kda_mod
from model.ops.backends import force_cuda_backends
from model.ops.kda import KDAGate, chunk_kda
from tests.helpers.fla import bind_as

H, K, V = 2, 8, 4


def _fla_0_4_0(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Signature of fla 0.4.0's chunk_kda (no in-kernel gate, no cu_seqlens_cpu)."""


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm_fwd: x / sqrt(sum(x^2) + 1e-6), fp32 inside."""
    xf = x.float()
    return xf / torch.sqrt(xf.square().sum(-1, keepdim=True) + 1e-6)


def fla_semantics(a: dict, extra: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What fla's chunk_kda returns for these bound arguments, from fla's own references."""
    q, k, v, g, beta = (a[n] for n in ("q", "k", "v", "g", "beta"))
    if a.get("use_qk_l2norm_in_kernel"):
        q, k = fla_l2norm(q), fla_l2norm(k)
    if a.get("use_gate_in_kernel"):
        lb = a["lower_bound"]
        g = (naive_kda_gate(g, extra["A_log"], extra["dt_bias"]) if lb is None else
             naive_kda_lowerbound_gate(g, extra["A_log"], extra["dt_bias"], lb))
    if a.get("use_beta_sigmoid_in_kernel"):
        beta = beta.float().sigmoid()
    cu, h0, keep = a["cu_seqlens"], a["initial_state"], a["output_final_state"]
    if cu is None:
        return naive_recurrent_kda(q, k, v, g, beta, a["scale"], h0, keep)
    outs, states = [], []
    bounds = cu.tolist()  # test code: the oracle may read the host
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if h0 is None else h0[i:i + 1]
        o, st = naive_recurrent_kda(*(x[:, s:e] for x in (q, k, v, g, beta)), a["scale"], init,
                                    True)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, 1), (torch.cat(states) if keep else None)


def make_stand_in(signature_of, calls: list[dict]):
    """A stand-in for fla's chunk_kda that checks each call against fla's contract."""
    sig = inspect.signature(signature_of)

    def stand_in(*args, **kwargs):
        a, extra = bind_as(sig, args, kwargs)  # raises on an argument fla does not take
        gated = a.get("use_gate_in_kernel", False)
        assert set(extra) <= {"chunk_size", "A_log", "dt_bias"}, extra
        if gated:  # the whole prologue, as the layer's math needs it
            assert a["use_qk_l2norm_in_kernel"] and a["use_beta_sigmoid_in_kernel"]
            assert not a["allow_neg_eigval"]
            lb = a["lower_bound"]
            assert a["safe_gate"] == (lb is not None) and (lb is None or -5 <= lb < 0)
            A_log, dt_bias = extra["A_log"], extra["dt_bias"]
            assert A_log.shape == (H,) and dt_bias.shape == (H * K,)
            assert A_log.dtype == dt_bias.dtype == torch.float32
            assert a["g"].dtype == a["v"].dtype  # the raw projection, no fp32 gate tensor
        else:
            assert not any(a.get(n) for n in ("use_qk_l2norm_in_kernel", "safe_gate",
                                              "use_beta_sigmoid_in_kernel"))
            assert {"A_log", "dt_bias"}.isdisjoint(extra)
            assert a["g"].dtype == torch.float32 and bool((a["g"] < 0).all())  # activated
        cu = a["cu_seqlens"]
        if cu is not None:
            assert a["q"].shape[0] == 1 and cu.dtype == torch.int32
        calls.append({"gated": gated, "lower_bound": a.get("lower_bound"),
                      "grad": torch.is_grad_enabled() and a["q"].requires_grad})
        o, ht = fla_semantics(a, extra)
        return o.to(a["v"].dtype), ht

    stand_in.__signature__ = sig
    return stand_in


def inputs(packed: bool, dtype=torch.float32, seed: int = 0) -> tuple[dict, dict]:
    """Raw projections as the layer makes them (q/k unnormalised, f, b logits), gate params."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, 47) if packed else (2, 21)
    N = 3 if packed else B

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(dtype)

    x = {"q": rnd(B, T, H, K), "k": rnd(B, T, H, K), "v": rnd(B, T, H, V),
         "f": rnd(B, T, H, K, s=2.0), "b": rnd(B, T, H),
         "A_log": 0.3 * torch.randn(H, generator=gen),
         "dt_bias": 0.5 * torch.randn(H * K, generator=gen),
         "h0": 0.2 * torch.randn(N, H, K, V, generator=gen)}
    kw = {}
    if packed:  # an empty document in the middle
        cu = torch.tensor([0, 20, 20, T], dtype=torch.int32)
        kw = {"cu_seqlens": cu.long(), "cu_seqlens_cpu": cu}
        x["h0"] = x["h0"][:3]
    return x, kw


def run(leaves: dict, lower_bound, kw: dict):
    gate = KDAGate(leaves["A_log"], leaves["dt_bias"], lower_bound)
    return chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["f"], leaves["b"], scale=0.4,
                     initial_state=leaves["h0"], output_final_state=True, chunk_size=16,
                     gate=gate, **kw)


def fla_vs_reference(monkeypatch, signature_of, lower_bound, packed: bool):
    calls: list[dict] = []
    monkeypatch.setattr(kda_mod, "_load_fla", lambda: make_stand_in(signature_of, calls))
    base, kw = inputs(packed)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(base["v"].shape, generator=gen)
    results = []
    for forced in (True, False):  # the custom ops around the stand-in, then our CPU path
        leaves = {n: x.clone().requires_grad_() for n, x in base.items()}
        with force_cuda_backends(forced):
            o, s = run(leaves, lower_bound, kw)
        ((o * w).sum() + s.square().sum()).backward()
        results.append((o, s, {n: x.grad for n, x in leaves.items()}))
    (o1, s1, g1), (o2, s2, g2) = results
    assert (o1 - o2).abs().max() <= 2e-5 and (s1 - s2).abs().max() <= 2e-5
    for n in base:
        scale = g2[n].abs().max().clamp_min(1.0)
        assert (g1[n] - g2[n]).abs().max() <= 2e-5 * scale, n
        assert g2[n].abs().max() > 0, n  # every input, A_log and dt_bias included, is reached
    return calls


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("packed", [True, False])
def test_prologue_runs_inside_fla(monkeypatch, lower_bound, packed) -> None:
    """fla 0.6 gets the raw projections with every prologue flag; the result and all
    gradients are our reference's (K3's bounded gate with safe_gate, and the softplus gate)."""
    calls = fla_vs_reference(monkeypatch, fla_chunk_kda, lower_bound, packed)
    assert [(c["gated"], c["lower_bound"], c["grad"]) for c in calls] == [
        (True, lower_bound, False), (True, lower_bound, True)]  # forward, backward's recompute


def test_old_fla_gets_the_prologue_from_pytorch(monkeypatch) -> None:
    """fla without in-kernel gates (0.4.0's signature): the op activates the inputs first,
    differentiably, and fla gets plain semantics."""
    monkeypatch.setattr(kda_mod, "_fla_version", lambda: (0, 4, 0))
    calls = fla_vs_reference(monkeypatch, _fla_0_4_0, -5.0, packed=True)
    assert [c["gated"] for c in calls] == [False, False]


def test_lower_bound_outside_safe_range_stays_in_pytorch(monkeypatch) -> None:
    """safe_gate takes bounds in [-5, 0) only: a -8 bound keeps the prologue in PyTorch."""
    calls = fla_vs_reference(monkeypatch, fla_chunk_kda, -8.0, packed=False)
    assert [c["gated"] for c in calls] == [False, False]


def test_bf16_projections_reach_fla_in_bf16(monkeypatch) -> None:
    """The gate pre-activation and beta logits reach fla as the projections' bf16 (no fp32
    gate tensor is written); A_log / dt_bias as fp32 even when FSDP hands bf16 copies."""
    calls: list[dict] = []
    monkeypatch.setattr(kda_mod, "_load_fla", lambda: make_stand_in(fla_chunk_kda, calls))
    base, kw = inputs(packed=True, dtype=torch.bfloat16)
    base["A_log"], base["dt_bias"] = base["A_log"].bfloat16(), base["dt_bias"].bfloat16()
    with force_cuda_backends():
        o, _ = run(base, -5.0, kw)
    ref, _ = run({n: x.float() for n, x in base.items()}, -5.0, kw)
    assert o.dtype == torch.bfloat16 and calls[0]["gated"]
    assert (o.float() - ref).abs().max() <= 0.05 * ref.abs().max()

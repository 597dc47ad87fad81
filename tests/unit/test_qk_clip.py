"""QK-Clip (`train.optim.qk_clip`) on the debug model's Gated MLA layers, against an exact oracle of
the largest pre-softmax logit (float64 q k^T per document, from the attention inputs)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import model.mla as mla_mod
from model.build import build_model
from model.config import load_model_config
from train.optim.qk_clip import (
    AttnLogits,
    mla_modules,
    qk_clip,
    qk_clip_metrics,
    reset_logits,
    track_logits,
)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 48), generator=g)
    cu = torch.tensor([0, 20, 48, 60, 96])  # documents over the flattened 2 x 48 tokens
    return ids, cu


def _exact_max(model, ids, cu, monkeypatch, inputs: dict | None = None):
    """Per MLA layer, each head's largest scaled logit over causal same-document pairs, and
    each layer's inputs. With `inputs` (an earlier call's), every layer runs on those, so a
    clip of one layer does not change what a later one sees."""
    seen: dict[int, torch.Tensor] = {}
    real = mla_mod.packed_causal_attention
    layer_of = {id(m): i for i, m in mla_modules(model)}
    current, captured = [], {}

    def spy(q, k, v, packing, scale, logit_bound=False):
        B, T, H, D = q.shape
        qf, kf = q.double().reshape(B * T, H, D), k.double().reshape(B * T, H, D)
        bounds = packing.cu_seqlens.tolist()  # the oracle may read the host
        best = torch.full((H,), -math.inf, dtype=torch.float64)
        for s, e in zip(bounds[:-1], bounds[1:]):
            sc = torch.einsum("qhd,khd->hqk", qf[s:e], kf[s:e]) * scale
            causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
            best = torch.maximum(best, sc.masked_fill(~causal, -math.inf).amax(dim=(1, 2)))
        seen[current[-1]] = best
        return real(q, k, v, packing, scale, logit_bound)

    def pre(mod, args):
        current.append(layer_of[id(mod)])
        captured[layer_of[id(mod)]] = args

    hooks = [m.register_forward_pre_hook(pre) for _, m in mla_modules(model)]
    for _, m in mla_modules(model):
        monkeypatch.setattr(m, "attention", spy)
    try:
        if inputs is None:
            model(ids, cu)
        else:
            for layer, m in mla_modules(model):
                m(*inputs[layer])
    finally:
        for _, m in mla_modules(model):
            monkeypatch.setattr(m, "attention", real)
        for h in hooks:
            h.remove()
    return seen, captured


@pytest.fixture()
def setup(monkeypatch):
    model = build_model("debug", seed=0).double().train()
    with torch.no_grad():  # larger q/k weights so that the logits are worth clipping
        for _, m in mla_modules(model):
            (m.q_b_proj if hasattr(m, "q_b_proj") else m.q_proj).weight.mul_(6.0)
            m.kv_b_proj.weight.mul_(6.0)
    track_logits(model, torch.device("cpu"))
    ids, cu = _batch(load_model_config("debug").vocab_size)
    return model, ids, cu


def test_bound_is_the_lse_upper_bound_of_the_exact_max(setup, monkeypatch):
    model, ids, cu = setup
    reset_logits(model)
    exact, _ = _exact_max(model, ids, cu, monkeypatch)
    longest = int((cu[1:] - cu[:-1]).max())
    for layer, m in mla_modules(model):
        b = m.logit_max.double()
        assert (b >= exact[layer] - 1e-9).all() and (b <= exact[layer] + math.log(longest)).all()


def test_clip_caps_clipped_heads_and_leaves_the_others_bit_identical(setup, monkeypatch):
    model, ids, cu = setup
    reset_logits(model)
    before, inputs = _exact_max(model, ids, cu, monkeypatch)
    layers = [i for i, _ in mla_modules(model)]
    S_all = torch.stack([m.logit_max for _, m in mla_modules(model)])
    tau = float(S_all.median())  # some heads above, some below
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    H = mla_modules(model)[0][1].num_heads
    n_layers = max(layers) + 1
    S = qk_clip(model, tau, n_layers, H, torch.device("cpu"))
    after, _ = _exact_max(model, ids, cu, monkeypatch, inputs)  # the same layer inputs
    clipped_total = 0
    for layer, m in mla_modules(model):
        s = S[layer]
        clipped = s > tau
        clipped_total += int(clipped.sum())
        assert (after[layer][clipped] <= tau * (1 + 1e-6)).all()
        f = torch.where(clipped, tau / s, 1.0).double()
        # logits shrink by f (the factors are fp32: sqrt(f)^2 = f to 1e-7)
        torch.testing.assert_close(after[layer], before[layer] * f, rtol=1e-6, atol=1e-9)
        prefix = f"layers.{layer}.self_attn."
        qname = "q_b_proj.weight" if hasattr(m, "q_b_proj") else "q_proj.weight"
        for pname, per in ((qname, m.nope + m.rope), ("kv_b_proj.weight", m.nope + m.v_dim)):
            w0 = weights[prefix + pname].view(H, per, -1)
            w1 = m.get_parameter(pname).detach().view(H, per, -1)
            assert torch.equal(w0[~clipped], w1[~clipped]), (layer, pname)
            assert not torch.equal(w0[clipped], w1[clipped]) or not clipped.any()
        assert torch.equal(weights[prefix + "kv_a_proj_with_mqa.weight"],
                           m.kv_a_proj_with_mqa.weight)  # the shared k_R is never scaled
    assert 0 < clipped_total < len(layers) * H
    for n, p in model.named_parameters():  # nothing outside the MLA q / kv_b projections
        if "q_b_proj" not in n and "q_proj" not in n and "kv_b_proj" not in n:
            assert torch.equal(weights[n], p), n
    m = qk_clip_metrics(S, tau, layers)
    assert m["qk_clipped_heads"] == clipped_total and m["mla_layer_ids"] == layers
    assert m["attn_logit_max"] == pytest.approx(float(S_all.max()))


def test_tau_above_every_head_changes_nothing(setup):
    model, ids, cu = setup
    reset_logits(model)
    model(ids, cu)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    H = mla_modules(model)[0][1].num_heads
    qk_clip(model, 1e9, load_model_config("debug").num_hidden_layers, H, torch.device("cpu"))
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())


def _bare(model):
    """The parts of a `ParallelModel` that `AttnLogits` reads, for one rank."""
    return SimpleNamespace(model=model, device=torch.device("cpu"), tp_head_offset=lambda h: 0)


def test_tracking_without_clip_logs_the_bound_and_changes_nothing(monkeypatch):
    """`train.track_attn_logits` with QK-Clip off: each MLA layer's attn_logit_max is the LSE
    bound of its exact largest logit (float64 oracle), no weight moves, no clip count is made."""
    model = build_model("debug", seed=0).double().train()
    logits = AttnLogits(_bare(model), tau=None, track=None)  # default: on, the model has MLA
    assert logits.on and logits.mla == [i for i, _ in mla_modules(model)]
    ids, cu = _batch(load_model_config("debug").vocab_size)
    logits.reset()
    exact, _ = _exact_max(model, ids, cu, monkeypatch)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = logits.after_step()
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert "qk_clipped_heads" not in m and m["mla_layer_ids"] == logits.mla
    longest = int((cu[1:] - cu[:-1]).max())
    for layer, got in zip(logits.mla, m["attn_logit_max_per_layer"], strict=True):
        true_max = float(exact[layer].max())
        assert true_max - 1e-6 <= got <= true_max + math.log(longest), (layer, got, true_max)
    assert m["attn_logit_max"] == max(m["attn_logit_max_per_layer"])
    off = build_model("debug", seed=0).double().train()
    quiet = AttnLogits(_bare(off), tau=None, track=False)
    assert not quiet.on and quiet.after_step() == {}
    assert all(mod.logit_max is None for _, mod in mla_modules(off))

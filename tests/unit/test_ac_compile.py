"""Activation checkpointing (per layer, per op) and per-layer compile change no number: the loss,
every gradient and the Quantile-Balancing statistics equal the plain model's (float64 for
checkpointing; compile in fp32, the dtype whose expert GEMM takes the `torch._grouped_mm` path
that compiled graphs must avoid on CPU)."""

from __future__ import annotations

import pytest
import torch

from parallel.activation_checkpoint import apply_activation_checkpointing, apply_compile
from parallel.grad_accumulation import attach_local_main_grads
from tests.helpers.tiny import debug_config, packed_batch

SMALL = debug_config(num_hidden_layers=4, full_attn_layers=[4])  # layers 0-2 KDA, 3 MLA


def _run(mode: str, dtype: torch.dtype = torch.float64):
    from model.build import build_model

    model = build_model(SMALL, seed=0).to(dtype)
    layers = list(model.layers.values())
    if mode == "compile":
        apply_compile(layers, backend="aot_eager")
    else:
        apply_activation_checkpointing(layers, mode)
    ids, labels, cu = packed_batch()
    loss, _ = model(ids, cu, labels=labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = [m.gate.qb_counts.clone() for m in model.moe_layers()]
    return loss.detach(), grads, counts


@pytest.fixture(scope="module")
def plain():
    return _run("none")


def test_compile_equals_eager_fp32():
    ref_loss, ref_grads, ref_counts = _run("none", torch.float32)
    loss, grads, counts = _run("compile", torch.float32)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")
    assert all(torch.equal(c, r) for c, r in zip(counts, ref_counts, strict=True))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_loss_grads_and_counts(plain, mode):
    loss, grads, counts = _run(mode)
    torch.testing.assert_close(loss, plain[0], rtol=1e-12, atol=0)
    assert grads.keys() == plain[1].keys()
    for n, g in plain[1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=n: f"{n}: {m}")
    for c, ref in zip(counts, plain[2], strict=True):  # recomputation must not count twice
        assert torch.equal(c, ref) and int(ref.sum()) > 0


def test_checkpointing_recomputes(monkeypatch):
    """`full` really recomputes: each layer's forward runs twice per step."""
    from model.build import build_model
    from model.decoder import DecoderLayer

    calls = []
    orig = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward",
                        lambda self, *a, **k: calls.append(self.layer_idx) or orig(self, *a, **k))
    model = build_model(SMALL, seed=0)
    apply_activation_checkpointing(list(model.layers.values()), "full")
    ids, labels, cu = packed_batch()
    model(ids, cu, labels=labels)[0].backward()
    assert sorted(calls) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="activation checkpoint mode"):
        apply_activation_checkpointing([], "sometimes")


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_weight_gradients_accumulate_in_compiled_layers(compiled):
    """With buffers attached, two backward passes add each fusable weight's gradient into its
    buffer (eager, and compiled layers: AOTAutograd keeps the backward's in-place add on a
    forward input) and leave `.grad` unset; the sum equals autograd's accumulated `.grad`
    of the plain model, and every other gradient is unchanged."""
    from model.build import build_model

    ref = build_model(SMALL, seed=0)
    model = build_model(SMALL, seed=0)
    mains = attach_local_main_grads(model)
    if compiled:
        apply_compile(list(model.layers.values()), backend="aot_eager")
    ids, labels, cu = packed_batch()
    for m in (ref, model):
        for _ in range(2):
            loss, _ = m(ids, cu, labels=labels)
            loss.backward()
    assert len(mains) > 10
    for name, p in model.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        if want is None:  # not used by this loss (the MTP head of the plain model too)
            assert p.grad is None and name not in mains, name
            continue
        if name in mains:
            assert p.grad is None, name
            got = mains[name]
        else:
            got = p.grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")

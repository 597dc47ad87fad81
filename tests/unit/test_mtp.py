"""The MTP module (`model/mtp.py`) against a direct float64 computation from the main model's
final states and the embedding: targets from the document boundaries (not the labels), each
document's MTP layer run on that document alone, RMSNorm and the cross-entropy written out;
the [0 0 I] AttnRes-feature projection passes the final state; a zero weight leaves the main
loss and every shared gradient as without MTP; bad settings name the field; `model.inspect`
counts the module apart; its matrices join Muon's blocks and its MLA QK-Clip."""

from __future__ import annotations

import pytest
import torch

from model.config import ConfigError
from model.mtp import mtp_targets
from model.packing import Packing
from tests.helpers.tiny import debug_config, packed_batch, tiny_model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _oracle_mtp_sum(model, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Sum over positions t with t+2 in t's document of -log p(token t+2)."""
    cfg, mtp = model.config, model.mtp
    eps = cfg.rms_norm_eps
    B, T = ids.shape
    with torch.no_grad():
        prefix, blocks = model.embed(ids)
        prefix, blocks = model.run_layers(prefix, blocks, model.packing(ids, cu))
        h = model.output_state(prefix, blocks).flatten(0, 1)  # [B*T, d]
    flat = ids.flatten()
    E, W = model.embed_tokens.weight, model.lm_head.weight
    total = torch.zeros((), dtype=torch.float64)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):  # one document at a time (an oracle loop)
        if b - a < 3:
            continue
        pos = torch.arange(a, b - 1)  # t with t+1 in the document: the layer's inputs
        x = torch.cat([_rms(E[flat[pos + 1]], mtp.enorm.weight, eps),
                       _rms(h[pos], mtp.hnorm.weight, eps)], dim=-1) @ mtp.eh_proj.weight.T
        with torch.no_grad():
            n = b - 1 - a
            alone = Packing.from_host(None, 1, n, "cpu")  # the document as its own batch
            y, _ = mtp.layer(x.unsqueeze(0), blocks[:0, :1, :n], alone)
        logits = _rms(y[0], mtp.shared_head.norm.weight, eps) @ W.T  # [b-1-a, V]
        logp = torch.log_softmax(logits[:-1], dim=-1)  # t = a .. b-3 predict t+2
        total -= logp.gather(1, flat[pos[:-1] + 2][:, None]).sum()
    return total


def test_mtp_loss_equals_a_direct_computation():
    model = tiny_model(dtype=torch.float64, num_nextn_predict_layers=1)
    ids, labels, cu = packed_batch(batch=2, seq=48, seed=3)
    with torch.no_grad():
        total, n = model(ids, cu, labels=labels)
    (mtp_sum,) = model.mtp_loss_sums
    want = _oracle_mtp_sum(model, ids, cu)
    torch.testing.assert_close(mtp_sum, want, rtol=1e-10, atol=1e-9)
    off = tiny_model(dtype=torch.float64)  # the same weights by name, without MTP
    with torch.no_grad():
        main, n_off = off(ids, cu, labels=labels)
    assert int(n) == int(n_off)
    torch.testing.assert_close(total, main + 0.1 * want, rtol=1e-10, atol=1e-9)


def test_mtp_targets_stop_two_tokens_before_each_document_end():
    ids, labels, cu = packed_batch(batch=2, seq=40, seed=1)
    got = mtp_targets(labels).flatten()
    flat, T = ids.flatten(), ids.shape[1]
    want = torch.full_like(flat, -100)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b - 2):
            want[t] = flat[t + 2]
    # the row's last label (token T, outside the row) is a target of the main loss only
    assert torch.equal(got, want), (got, want)
    assert (got[T - 1::T] == -100).all()


def test_attn_res_feature_projection_starts_as_the_final_state():
    ids, labels, cu = packed_batch(batch=1, seq=40, seed=2)
    plain = tiny_model(dtype=torch.float64, num_nextn_predict_layers=1)
    fused = tiny_model(dtype=torch.float64, num_nextn_predict_layers=1, mtp_attn_res_blocks=[1])
    d = fused.config.hidden_size
    assert fused.mtp.h_proj.weight.shape == (d, 2 * d)
    with torch.no_grad():
        a, _ = plain(ids, cu, labels=labels)
        b, _ = fused(ids, cu, labels=labels)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    loss, _ = fused(ids, cu, labels=labels)
    loss.backward()
    assert fused.mtp.h_proj.weight.grad[:, :d].abs().sum() > 0  # the snapshot half learns


def test_zero_weight_changes_no_shared_gradient():
    ids, labels, cu = packed_batch(batch=2, seq=32, seed=4)
    on = tiny_model(dtype=torch.float64, num_nextn_predict_layers=1, mtp_loss_weight=0.0)
    off = tiny_model(dtype=torch.float64)
    for m in (on, off):
        s, _ = m(ids, cu, labels=labels)
        s.backward()
    grads = dict(on.named_parameters())
    for name, p in off.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-12, atol=1e-12,
                                       msg=name)
    assert on.mtp.eh_proj.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("kw,field", [
    ({"num_nextn_predict_layers": 2}, "model.num_nextn_predict_layers"),
    ({"mtp_loss_weight": -1.0}, "model.mtp_loss_weight"),
    ({"mtp_layer_type": "gqa"}, "model.mtp_layer_type"),
    ({"mtp_attn_res_blocks": [9]}, "model.mtp_attn_res_blocks"),
])
def test_bad_mtp_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field) as e:
        debug_config(**kw)
    assert "\n" not in str(e.value)


def test_inspect_counts_mtp_apart():
    from model.inspect import describe

    base = describe("debug")
    on = describe("debug", {"num_nextn_predict_layers": 1})
    model = tiny_model(num_nextn_predict_layers=1)
    assert on["mtp_params"] == sum(p.numel() for p in model.mtp.parameters()) > 0
    assert 0 < on["mtp_active_params"] < on["mtp_params"]  # routed experts count top-k / E
    for key in ("total_params", "active_params", "embedding_params"):
        assert on[key] == base[key], key
    assert base["mtp_params"] == 0


def test_mtp_joins_muon_blocks_and_qk_clip():
    from train.optim.muon import Blocks, muon_blocks
    from train.optim.qk_clip import mla_modules

    model = tiny_model(num_nextn_predict_layers=1)
    blocks = muon_blocks(model)
    cfg = model.config
    assert blocks["mtp.layer.self_attn.q_b_proj.weight"] == Blocks((cfg.qk_head_dim,))  # heads
    assert blocks["mtp.layer.self_attn.kv_b_proj.weight"] == Blocks(
        (cfg.qk_nope_head_dim, cfg.v_head_dim))
    assert blocks["mtp.eh_proj.weight"] == Blocks()
    assert blocks["mtp.layer.block_sparse_moe.experts.w1"] == Blocks()  # each expert alone
    assert not any(n.startswith(("mtp.enorm", "mtp.hnorm", "mtp.shared_head")) for n in blocks)
    assert "mtp.layer.block_sparse_moe.gate.weight" not in blocks  # the router: AdamW
    assert mla_modules(model)[-1] == (cfg.num_hidden_layers, model.mtp.layer.self_attn)

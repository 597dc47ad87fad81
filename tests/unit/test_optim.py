import math

import pytest

from model.build import build_model
from train.config import OptimConfig
from train.optim import build_optimizer, lr_factor


def test_cosine_with_one_percent_warmup():
    cfg = OptimConfig(schedule="cosine", warmup_frac=0.01, min_lr_ratio=0.1)
    f = [lr_factor(s, 1000, cfg) for s in range(1000)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # 10 warmup steps
    mid = 10 + (1000 - 10) // 2
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), abs=1e-2)
    assert f[-1] == pytest.approx(0.1, abs=1e-4)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_wsd_is_flat_then_decays_linearly():
    cfg = OptimConfig(schedule="wsd", warmup_frac=0.01, min_lr_ratio=0.0, decay_frac=0.2)
    f = [lr_factor(s, 100, cfg) for s in range(100)]
    assert f[0] == 1.0 and all(x == 1.0 for x in f[1:80])
    assert f[80] == pytest.approx(1 - 1 / 20) and f[99] == pytest.approx(0.0)


def test_no_weight_decay_on_norms_gates_and_attnres():
    model = build_model("debug", seed=0)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in opt.param_groups[0]["params"]}
    no_decay = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[1]["weight_decay"] == 0.0
    for n in ("layers.1.self_attn.A_log", "layers.1.self_attn.dt_bias", "norm.weight",
              "layers.2.mlp_res_proj.weight", "layers.2.input_layernorm.weight"):
        assert n in no_decay, n
    for n in ("layers.1.self_attn.q_proj.weight", "layers.2.block_sparse_moe.experts.w1",
              "lm_head.weight", "layers.2.block_sparse_moe.gate.weight"):
        assert n in decay, n
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"layers.0.self_attention_res_norm.weight",
                      "layers.0.self_attention_res_proj.weight"}
    assert not (decay | no_decay) & frozen

import math
import re

import pytest

from model.build import build_model
from train.config import OptimConfig
from train.optim.build import build_optimizer, lr_factor


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


@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clip_folded_into_fused_adamw_matches_scaling_the_gradients(max_norm):
    """On CUDA the clip factor goes to fused AdamW as grad_scale (one gradient pass saved): the
    step equals clipping in place then stepping (torch's fused AdamW also runs on CPU), and
    the gradients are not touched before the step."""
    import torch

    from parallel.grads import clip_grad_norm, takes_grad_scale

    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]
    grads = [torch.randn(p.shape, generator=gen) for p in base]
    results = []
    for fold in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in base]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
        assert takes_grad_scale(opt)
        for step in range(2):  # a new clip factor each step (Adam is invariant to a fixed one)
            for p, g in zip(params, grads):
                p.grad = g * (1 + 4 * step)
            norm = clip_grad_norm(params, max_norm, optimizer=opt if fold else None)
            if fold:
                assert all(torch.equal(p.grad, g * (1 + 4 * step)) for p, g in zip(params, grads))
            opt.step()
        results.append([p.detach() for p in params])
    want = 5 * math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    assert norm == pytest.approx(want)
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    moved = max(float((a - p).abs().max()) for a, p in zip(results[0], base))
    assert moved > 0.05  # the step did something
    assert not takes_grad_scale(torch.optim.AdamW(
        [torch.nn.Parameter(torch.zeros(2))], fused=False))


@pytest.mark.parametrize("recipe, hidden", [("k3_small", 2048), ("k3", 7168)])
def test_recipes_are_the_presets_with_muon(recipe, hidden):
    """`+recipe=<preset>` composes the model preset with optim=muon (QK-Clip at 100) and one
    MTP layer (AttnRes features of blocks 1 and 4), and validates; the preset alone keeps AdamW
    and no MTP."""
    from launch.pretrain import load_job

    job = load_job(["+cluster=local_cpu", f"+recipe={recipe}"], 1)
    assert (job.model.hidden_size, job.optim.name, job.optim.qk_clip_tau) == (hidden, "muon",
                                                                              100.0)
    assert (job.model.num_nextn_predict_layers, job.model.mtp_attn_res_blocks) == (1, [1, 4])
    plain = load_job(["+cluster=local_cpu", f"model={recipe}"], 1)
    assert (plain.optim.name, plain.model.num_nextn_predict_layers) == ("adamw", 0)


@pytest.mark.parametrize("override, message", [
    ("optim.ns_steps=0", "optim.ns_steps=0 must be > 0"),
    ("optim.momentum=1.5", "optim.momentum=1.5 must be in [0, 1)"),
    ("optim.qk_clip_tau=-1", "optim.qk_clip_tau=-1.0 must be > 0, or null"),
    ("optim.name=sgd", "optim.name='sgd': use optim=adamw or optim=muon")])
def test_bad_muon_settings_are_one_line(override, message):
    from launch.pretrain import load_job
    from model.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job(["+cluster=local_cpu", "optim=muon", override], 1)

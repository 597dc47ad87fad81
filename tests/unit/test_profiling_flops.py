"""`train.profile_steps` (torch.profiler ranges per layer and op family, a Chrome trace and a
summary) and the trainer's per-document FLOP count behind its MFU."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import ConfigError
from tests.helpers.tiny import debug_config, packed_batch, tiny_model
from train.observe.flops import flops_per_token, mla_flops_per_token, step_flops
from train.observe.profiling import StepProfiler, format_summary


def test_profiler_writes_trace_and_summary(tmp_path):
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=4, full_attn_layers=[4])  # 0-2 KDA, 3 MLA
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = StepProfiler([2, 3], model, opt, tmp_path, 0, torch.device("cpu"))
    ids, labels, cu = packed_batch()
    summaries = []
    for step in range(1, 5):
        prof.before_step(step)
        loss, _ = model(ids, cu, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        summaries.append(prof.after_step(step))
    assert summaries[0] is None and summaries[1] is None and summaries[3] is None
    ranges = summaries[2]["ranges"]
    assert summaries[2]["steps"] == [2, 3]
    assert ranges["step"]["calls"] == 2 and ranges["optimizer"]["calls"] == 2
    assert {"layer.0.kda_dense", "layer.1.kda_moe", "layer.3.mla_moe"} <= ranges.keys()
    assert ranges["layer.1.kda_moe"]["calls"] == 2
    for family in ("kda", "mla_attention", "moe_router", "moe_routed_experts", "norm",
                   "embedding", "short_conv", "mlp"):
        assert ranges[family]["calls"] >= 2 and ranges[family]["cpu_ms"] > 0, family
    assert ranges["backward"]["calls"] > 0
    trace = json.loads((tmp_path / "profile" / "trace-rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "k3/layer.3.mla_moe" in names and "k3/optimizer" in names
    assert json.loads((tmp_path / "profile" / "summary-rank0.json").read_text()) == summaries[2]
    assert "layer.3.mla_moe" in format_summary(summaries[2])
    # the hooks are gone: a later forward adds no ranges and nothing fails
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_profile_steps_validation():
    from train.config import JobConfig, validate_job

    job = JobConfig()
    job.train.steps = 5
    for bad in ([3], [0, 2], [4, 3], [2, 6]):
        job.train.profile_steps = bad
        with pytest.raises(ConfigError, match=r"train.profile_steps") as e:
            validate_job(job, 1)
        assert "\n" not in str(e.value)


def test_step_flops_counts_attention_per_document():
    cfg = debug_config()
    n_mla = cfg.layer_types.count("mla")
    T, B = 64, 4
    full = step_flops(cfg, [T] * B)
    assert full == pytest.approx(flops_per_token(cfg, T) * B * T, rel=1e-12)
    # 4 documents of 16 in each row: same tokens and weights, attention a quarter of it
    packed = step_flops(cfg, [16] * (4 * B))
    attn_full = n_mla * mla_flops_per_token(cfg, 1) * B * T * T
    kda_gap = full - packed - 0.75 * attn_full
    assert kda_gap >= 0  # KDA's chunk is capped by short documents too
    assert full - packed >= 0.75 * attn_full
    assert step_flops(cfg, []) == 0.0 and step_flops(cfg, [0, 0]) == 0.0

"""Layout arithmetic without processes: ParallelDims validation, pipeline stage splits, stage
placement per schedule, the AttnRes state shapes that cross stage boundaries."""

from __future__ import annotations

import pytest
import torch

from model.build import build_model
from model.config import ConfigError, load_model_config
from parallel.dims import ParallelDims
from parallel.pipeline import layer_costs, split_stages, stage_indices, stage_io_meta
from train.config import ParallelConfig


def dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_dp_shard_fills_the_world():
    d = dims(16, tp=2, pp=2)
    assert (d.pp, d.dp_shard, d.tp, d.dp) == (2, 4, 2, 4)


@pytest.mark.parametrize("kw, world, field", [
    (dict(tp=3), 6, "model.kda_num_heads"),
    (dict(pp=2, pp_schedule="Interleaved1F1B"), 4, "pp_virtual_stages"),
    (dict(pp=2, pp_schedule="1F1B", pp_virtual_stages=2), 4, "pp_virtual_stages"),
    (dict(pp=2, pp_schedule="Zigzag"), 4, "pp_schedule"),
    (dict(cp=3), 3, "data.seq_len=64"),  # each row splits into cp shards
    (dict(cp=2, tp=4), 8, "parallel.cp=2"),  # 1 MLA head per tp rank: Ulysses splits heads
    (dict(cp=2, ep=3), 6, "parallel.ep=3"),  # experts over dp_shard x cp x tp = 6: 8 % 3
    (dict(tp=2), 3, "world size 3"),
])
def test_bad_layouts_name_the_field(kw, world, field):
    cfg = load_model_config("debug")
    with pytest.raises(ConfigError) as e:
        dims(world, **kw).validate_model(cfg, seq_len=64, microbatches=4)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_model_checks():
    cfg = load_model_config("debug")
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        dims(16, pp=8, pp_schedule="Interleaved1F1B", pp_virtual_stages=2).validate_model(cfg)
    with pytest.raises(ConfigError, match="data.seq_len=63"):
        dims(2, tp=2).validate_model(cfg, seq_len=63)
    with pytest.raises(ConfigError, match="parallel.cp x parallel.tp = 4"):
        dims(4, cp=2, tp=2).validate_model(cfg, seq_len=66)
    with pytest.raises(ConfigError, match="short convolution's halo"):
        dims(32, cp=32).validate_model(cfg.__class__(**{**cfg.__dict__, "num_attention_heads":
                                                         32, "num_key_value_heads": 32}),
                                       seq_len=64)
    with pytest.raises(ConfigError, match="micro-batches"):
        dims(4, pp=4).validate_model(cfg, seq_len=64, microbatches=2)


def test_stages_are_contiguous_and_balanced():
    cfg = load_model_config("debug")
    costs = layer_costs(cfg)
    for n in (1, 2, 4, 8):
        splits = split_stages(cfg, n)
        assert [i for s in splits for i in s] == list(range(cfg.num_hidden_layers))
        assert all(splits)
    # the optimum beats (or equals) the naive equal-count split of 4 stages
    with_head = costs[:-1] + [costs[-1] + cfg.vocab_size * cfg.hidden_size]
    best = max(sum(with_head[i] for i in s) for s in split_stages(cfg, 4))
    naive = max(sum(with_head[i:i + 2]) for i in range(0, 8, 2))
    assert best <= naive


def test_k3_stage_split_is_balanced():
    cfg = load_model_config("k3")
    splits = split_stages(cfg, 16)
    costs = layer_costs(cfg)
    per_stage = [sum(costs[i] for i in s) for s in splits]
    assert max(per_stage) / min(per_stage) < 1.5
    assert splits[0][0] == 0 and splits[-1][-1] == 92


def test_stage_placement():
    assert stage_indices(0, 2, 4, "Interleaved1F1B") == [0, 2]
    assert stage_indices(1, 2, 4, "Interleaved1F1B") == [1, 3]
    assert stage_indices(0, 2, 4, "ZBVZeroBubble") == [0, 3]  # the V: first and last stage
    assert stage_indices(1, 4, 4, "1F1B") == [1]


def test_attnres_state_grows_one_snapshot_per_block():
    cfg = load_model_config("debug")  # block size 3: layers 0, 3, 6 start blocks
    splits = [[0, 1], [2, 3], [4, 5], [6, 7]]
    ins, outs = stage_io_meta(cfg, splits, 1, 2, 64, 2, torch.float32)
    assert ins[0].shape == (2, 32, 64) and ins[1].shape == (1, 2, 32, 64)  # emb only
    assert outs[1].shape == (2, 2, 32, 64)  # + block of layers 0-2 (started by layer 3)
    ins, outs = stage_io_meta(cfg, splits, 3, 2, 64, 2, torch.float32)
    assert ins[1].shape[0] == 2 and outs[0].shape == ()  # last stage returns the loss
    # the loss sum is fp32 under bf16 activations and fp64 in verification mode (torch 2.11's
    # pipelining checks the declared dtype)
    for act, loss in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        assert stage_io_meta(cfg, splits, 3, 2, 64, 2, act)[1][0].dtype == loss


def test_expert_parallel_borrows_tp_ranks():
    d = dims(4, tp=2, ep=2)  # each tp pair is one ep group; edp 2 over the dp ranks
    assert (d.dp_shard, d.edp, d.expert_grad_divisor) == (2, 2, 1.0)
    d = dims(8, tp=2, ep=4)  # ep groups span 2 dp x 2 tp ranks
    assert (d.dp_shard, d.edp, d.expert_grad_divisor) == (4, 2, 2.0)
    d = dims(4, tp=4, ep=2)  # ep inside a tp group
    assert (d.dp_shard, d.edp, d.expert_grad_divisor) == (1, 2, 0.5)
    d = dims(8, dp_replicate=2, ep=2)  # HSDP x EP: each replica group is its own ep x edp
    assert (d.dp, d.dp_shard, d.edp, d.expert_grad_divisor) == (8, 4, 2, 2.0)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide .* = 6") as e:
        dims(6, tp=2, ep=4)
    assert "\n" not in str(e.value)


def _dry_runs(*layouts: list[str]) -> list[dict]:
    """The first pipeline rank's row of `launch/dryrun.py` for each layout, in one process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = ("import json, sys; from launch import dryrun\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    assert dryrun.main(argv) == 0\n")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(list(layouts))],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    return [r for r in rows if r.get("pp_rank") == 0]


def test_dry_run_experts_are_not_replicated_over_tp():
    """tp 2 x dp_shard 2: ep 1 keeps every expert on both tp ranks (FSDP halves them); ep 4
    spreads them over all four ranks, a quarter each, with the dense part unchanged."""
    replicated, spread = _dry_runs(["--world", "4", "parallel.tp=2"],
                                   ["--world", "4", "parallel.tp=2", "parallel.ep=4"])
    experts_replicated = replicated["local_params"] - spread["local_dense_params"]
    assert experts_replicated == 2 * spread["local_expert_params"] > 0


def test_zero_bubble_schedules_need_torch_2_13():
    from train.config import ParallelConfig, zero_bubble_unsupported

    for schedule in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        zb = ParallelConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=2)
        assert zero_bubble_unsupported(zb, (2, 11)) and zero_bubble_unsupported(zb, (2, 12))
        assert not zero_bubble_unsupported(zb, (2, 13))
        assert not zero_bubble_unsupported(zb, (3, 0))
    interleaved = ParallelConfig(pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2)
    assert not zero_bubble_unsupported(interleaved, (2, 11))


def test_dry_run_counts_the_gradient_accumulator_and_kept_gathered_weights():
    """k3_small on dp_shard 2 (local_cpu: fp32 weights and reduction): with 2 micro-batches per
    step FSDP2's accumulator holds the whole gathered gradient, 4 B per parameter beyond the
    local shard; with one micro-batch, nothing; parallel.reshard_after_forward=false keeps the
    gathered weights (4 B per parameter) for the step."""
    base = ["--world", "2", "model=k3_small", "data.micro_batch=2", "data.seq_len=256"]
    one, two, kept = _dry_runs([*base, "data.global_batch=4"], [*base, "data.global_batch=8"],
                               [*base, "data.global_batch=8",
                                "parallel.reshard_after_forward=false"])
    assert (one["micro_batches"], two["micro_batches"]) == (1, 2)
    assert one["grad_accumulator_gib"] == 0 and one["gathered_weights_gib"] == 0
    full = sum(p.numel() for p in build_model("k3_small", device="meta").parameters())
    local = one["local_params"]
    assert full / 2 <= local < full / 2 + 1e6  # dim 0 padded to even
    assert two["grad_accumulator_gib"] == pytest.approx(4 * (full - local) / 2**30, abs=2e-3)
    assert two["total_gib"] == pytest.approx(one["total_gib"] + two["grad_accumulator_gib"],
                                             abs=2e-3)
    assert kept["gathered_weights_gib"] == pytest.approx(4 * full / 2**30, abs=2e-3)

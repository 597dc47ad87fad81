"""train.observe.metrics (jsonl, console, W&B, plots), train.observe.flops and
train.observe.model_stats."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import model.decoder as decoder_module
from model.build import build_model
from model.config import load_model_config
from model.inspect import count_params
from train.observe.flops import flops_per_token, mfu, peak_flops, peak_flops_for_name
from train.observe.metrics import MetricsLogger, memory_stats, resolve_wandb_mode
from train.observe.model_stats import (
    attnres_depth_weights,
    expert_load_matrix,
    moe_layer_indices,
    router_bias_matrix,
)

SCALARS = {"loss": 3.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_sec": 1234.5, "mfu": None,
           "max_mem_gib": 1.5}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WANDB_VARS = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR",
              "WANDB_ARTIFACT_DIR", "WANDB_DATA_DIR", "WANDB_BASE_URL", "NETRC",
              "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME in tmp_path, no W&B key or netrc; WANDB_* env restored after the test."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in WANDB_VARS:
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_one_object_per_step_and_resume_drops_later_steps(home, capsys):
    run = home / "run"
    with MetricsLogger(run, 0, 10, {}, wandb_mode="disabled") as logger:
        logger.start(0)
        for step in range(1, 6):
            logger.log_step(step, {**SCALARS, "loss": torch.tensor(3.0 - step / 10)})
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert set(rows[0]) == {"step", "time", *SCALARS}
    assert rows[0]["mfu"] is None and rows[1]["loss"] == pytest.approx(2.8)
    out = capsys.readouterr().out.splitlines()  # not a TTY: one plain line per step
    assert len(out) == 5 and out[0].startswith("step 1/10 | loss 2.9000 | lr 1.00e-03")
    assert "mfu" not in out[0] and "mem 1.50 GiB" in out[0]

    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a crash
    with MetricsLogger(run, 0, 10, {}, wandb_mode="disabled", console=False) as logger:
        logger.start(3)
        logger.log_step(4, SCALARS)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list(run.glob("*.tmp"))


def test_other_ranks_write_nothing(home, capsys):
    run = home / "run"
    logger = MetricsLogger(run, 1, 10, {}, wandb_mode="online")  # no key needed: never used
    logger.start(0)
    logger.log_step(1, SCALARS)
    assert logger.log_images(1, np.ones((2, 4)), np.ones((1, 2)) / 2, ["final"],
                             np.zeros((2, 4))) == {}
    logger.close()
    assert not run.exists() and capsys.readouterr().out == ""


def test_wandb_auto_without_key_is_offline_inside_run_dir(home):
    run = home / "run"
    assert resolve_wandb_mode("auto") == "offline"
    logger = MetricsLogger(run, 0, 10, {"model": "debug"}, run_name="t", console=False)
    assert logger.wandb_mode == "offline"
    logger.start(0)
    logger.log_step(1, SCALARS)
    logger.close()
    run_id = (run / "wandb_run_id.txt").read_text().strip()
    first = list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(first) == 1 and (first[0] / f"run-{run_id}.wandb").is_file()

    logger = MetricsLogger(run, 0, 10, {"model": "debug"}, console=False)
    logger.start(1)  # a resume continues the same W&B run id
    logger.log_step(2, SCALARS)
    logger.close()
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
    assert sorted(p.name for p in home.iterdir()) == ["run"]  # no ~/.cache, ~/.config, ...


def test_wandb_mode_resolution(home):
    netrc = home / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    netrc.chmod(0o600)
    assert resolve_wandb_mode("auto") == "online"
    assert resolve_wandb_mode("offline") == "offline"
    with pytest.raises(ValueError, match="wandb_mode"):
        resolve_wandb_mode("sometimes")


def test_wandb_disabled(home):
    run = home / "run"
    with MetricsLogger(run, 0, 10, {}, wandb_mode="disabled", console=False) as logger:
        logger.start(0)
        logger.log_step(1, SCALARS)
        assert logger.wandb_run is None
    assert not (run / "wandb").exists() and not (run / "wandb_run_id.txt").exists()
    assert sorted(p.name for p in home.iterdir()) == ["run"]


def check_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    assert os.path.getsize(path) <= 150_000
    assert np.var(matplotlib.image.imread(path)) > 0


@pytest.fixture(scope="module")
def debug_model():
    return build_model("debug")


def test_log_images_debug_and_k3_sized(home, debug_model):
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    weights, labels = attnres_depth_weights(debug_model, ids)
    load = np.random.default_rng(0).poisson(40, (7, 8))
    with MetricsLogger(home / "run", 0, 10, {}, wandb_mode="disabled") as logger:
        logger.start(0)
        paths = logger.log_images(7, load, weights, labels, router_bias_matrix(debug_model),
                                  moe_layer_indices(debug_model))
        assert sorted(paths) == ["attnres_depth", "expert_load", "router_bias"]
        for name, path in paths.items():
            assert path == home / "run" / "plots" / f"{name}-step-00000007.png"
            check_png(path)
        rng = np.random.default_rng(1)  # K3 shapes: 92 MoE layers x 896 experts, 186 mixes
        k3 = logger.log_images(8, rng.poisson(100, (92, 896)), rng.dirichlet(np.ones(9), 186),
                               [f"m{i}" for i in range(186)], rng.normal(0, 0.01, (92, 896)))
        for path in k3.values():
            check_png(path)


def test_flops_per_token():
    debug = load_model_config("debug")
    active = count_params(build_model(debug, device="meta"))["active_params"]
    assert flops_per_token(debug, 256) >= 6 * active
    assert flops_per_token(debug, 256) < flops_per_token(debug, 1024) < flops_per_token(debug,
                                                                                         4096)
    k3 = flops_per_token(load_model_config("k3"), 4096)
    assert 6 * 104.2e9 <= k3 <= 6 * 104.2e9 * 1.5
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert peak_flops("cpu") is None
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA B200") == 2.25e15
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("Some GPU") is None


def test_attnres_depth_weights_uniform_at_init(debug_model):
    model = debug_model.train()
    loads_before = expert_load_matrix(model).copy()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 10, 24, 48])  # packed documents work too
    weights, labels = attnres_depth_weights(model, ids, cu_seqlens=cu)
    assert weights.shape == (7 + 8 + 1, 4) and len(labels) == 16
    assert labels[:3] == ["L0.mlp", "L1.attn", "L1.mlp"] and labels[-1] == "final"
    np.testing.assert_allclose(np.nansum(weights, axis=1), 1.0, atol=1e-6)
    for row in weights:
        present = row[np.isfinite(row)]
        np.testing.assert_allclose(present, 1.0 / len(present), atol=1e-6)
        assert np.isfinite(row[0]) and np.isfinite(row[-1])  # emb first, current last
    assert model.training and decoder_module.mix.__name__ == "mix"
    np.testing.assert_array_equal(expert_load_matrix(model), loads_before)  # no router stats

    with torch.no_grad():  # a trained pseudo-query changes only its own row
        model.layers["7"].mlp_res_proj.weight.normal_(generator=torch.Generator().manual_seed(1))
    try:
        moved, _ = attnres_depth_weights(model, ids)
    finally:
        model.layers["7"].mlp_res_proj.weight.data.zero_()
    row = labels.index("L7.mlp")
    assert np.ptp(moved[row]) > 1e-3
    np.testing.assert_allclose(np.delete(moved, row, 0), np.delete(weights, row, 0), atol=1e-6,
                               equal_nan=True)


def test_expert_load_and_bias_matrices(debug_model):
    model = debug_model.train()
    expert_load_matrix(model, reset=True)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model.loss(ids, ids)
    load = expert_load_matrix(model, reset=True)
    assert load.shape == (7, 8) and load.dtype == np.int64
    assert (load.sum(1) == 2 * 16 * 2).all()  # tokens x top-k per MoE layer
    assert expert_load_matrix(model).sum() == 0
    bias = router_bias_matrix(model)
    assert bias.shape == (7, 8) and moe_layer_indices(model) == list(range(1, 8))


def test_memory_stats_cpu():
    stats = memory_stats("cpu")
    assert 0 < stats["max_mem_gib"] < 1024


def test_wandb_gets_one_chart_per_moe_layer():
    from train.observe.metrics import wandb_values

    record = {"loss": 2.5, "lr": None, "sample_ids": [4, 5, 6],
              "moe_layer_ids": [1, 2, 5], "ep_rank_load_static": [1.5, 1.2, 1.9],
              "ep_rank_load_replicated": [1.0, 1.0, 1.0], "odd_list": [1, 2]}
    out = wandb_values(record)
    assert out == {"loss": 2.5, "ep_rank_load_static/L1": 1.5, "ep_rank_load_static/L2": 1.2,
                   "ep_rank_load_static/L5": 1.9, "ep_rank_load_replicated/L1": 1.0,
                   "ep_rank_load_replicated/L2": 1.0, "ep_rank_load_replicated/L5": 1.0}


def test_wandb_key_is_never_written(home, monkeypatch, capsys):
    """Issue #18 item 8: the key is read from the environment only; no file of the run (config,
    metrics, W&B's offline run files) and no console line holds it."""
    from launch.pretrain import load_job
    from train.config import plain_config as _plain
    from train.config import save_resolved_config as _save_resolved_config

    secret = "k3secret0123456789abcdef0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run = home / "run"
    job = load_job(["+cluster=local_cpu", f"run.dir={run}"], 1)
    _save_resolved_config(job, run)
    logger = MetricsLogger(run, 0, 10, _plain(job), wandb_mode="offline", run_name="t",
                           console=True)
    logger.start(0)
    logger.log_step(1, SCALARS)
    logger.close()
    files = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any(".wandb" in p.name for p in files)
    for p in files:
        assert secret.encode() not in p.read_bytes(), p
    out = capsys.readouterr()
    assert secret not in out.out + out.err

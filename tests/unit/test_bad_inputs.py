"""The bad-input suite (issue #18 item 6): malformed configs, command lines, data, tokenizers and
run directories, each through the launcher's entry function in this process
(`launch.pretrain.main`: config checks, then `train.preflight` before any process group): one
line on stderr that starts with `error:` and names the field or file, exit code 2, no traceback,
nothing written. (`tests/e2e/test_failures.py` runs one as a real launch.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launch.pretrain import main

FAST = ["data.seq_len=64", "data.global_batch=8", "data.micro_batch=2",
        "data.stdlib_max_bytes=2000000", "metrics.wandb_mode=disabled"]

CONFIGS = [  # (overrides, what the line must name)
    (["parallel.tp=3"], "parallel.tp=3"),
    (["parallel.pp=100"], "parallel.pp=100"),
    (["parallel.ep=3"], "parallel.ep=3"),
    (["parallel.ep=2"], "parallel.ep=2"),
    (["parallel.cp=3"], "parallel.cp=3"),
    (["parallel.dp_shard=3"], "parallel.dp_shard"),
    (["parallel.pp_schedule=foo"], "parallel.pp_schedule"),
    (["parallel.activation_checkpoint=some"], "parallel.activation_checkpoint"),
    (["train.stepz=3"], "train.stepz"),
    (["optim.schedule=linear"], "optim.schedule"),
    (["eval.batches=0"], "eval.batches"),
    (["eval.every=-1"], "eval.every"),
    (["debug.slow_rank=5"], "debug.slow_rank"),
    (["data.max_epochs=0"], "data.max_epochs"),
    (["train.straggler_factor=0.5"], "train.straggler_factor"),
    (["train.steps=abc"], "train.steps"),
    (["model.hidden_size=abc"], "model.hidden_size"),
    (["optim=sgd"], "optim/sgd"),
    (["model=nonexistent"], "model/nonexistent"),
    (["+stage=nonexistent"], "stage/nonexistent"),
    (["data.seq_len=-5"], "data.seq_len"),
    (["data.global_batch=7"], "data.global_batch"),
    (["data.micro_batch=0"], "data.micro_batch"),
    (["optim.lr=-1"], "optim.lr"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["precision.gemm=fp4"], "precision.gemm"),
    (["cluster.device=tpu"], "cluster.device"),
    (["cluster.param_dtype=fp16"], "cluster.param_dtype"),
    (["checkpoint.interval=0"], "checkpoint.interval"),
    (["train.profile_steps=[5,1]"], "train.profile_steps"),
    (["metrics.wandb_mode=maybe"], "metrics.wandb_mode"),
    (["model.num_experts_per_token=99"], "model.num_experts_per_token"),
    (["model.num_hidden_layers=0"], "model.num_hidden_layers"),
    (["train.max_skipped_in_a_row=0"], "train.max_skipped_in_a_row"),
    (["debug.inject_nonfinite=[{step: 0}]"], "debug.inject_nonfinite"),
    (["model.vocab_size=100"], "model.vocab_size"),  # the byte tokenizer has 259 ids
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    (["data.dataset=/nonexistent/dir"], "data.dataset"),
    (["run.dir=/dev/null/run"], "run.dir"),
    (["checkpoint.init_from=/nonexistent/k3"], "checkpoint.init_from"),
    (["checkpoint.init_from=/nonexistent/k3", "model=debug"], "checkpoint.init_from"),
]


@pytest.fixture(autouse=True)
def _never_train(monkeypatch):
    """An input the checks let through must fail its test, not start training (whose exit
    would end this process)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the launcher accepted this input and went on to train")

    monkeypatch.setattr("train.distributed.init_distributed", refuse)


def _run(capsys, argv: list[str]) -> tuple[int, list[str]]:
    rc = main(["+cluster=local_cpu", *FAST, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def _assert_one_line(rc: int, err: list[str], name: str) -> None:
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and name in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("overrides, name", CONFIGS, ids=[" ".join(c[0]) for c in CONFIGS])
def test_bad_config(capsys, tmp_path, overrides, name):
    run_dir = tmp_path / "run"
    argv = [f"run.dir={run_dir}", *overrides] if not any(
        o.startswith("run.dir") for o in overrides) else overrides
    _assert_one_line(*_run(capsys, argv), name)
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A small prepared corpus (byte tokenizer)."""
    from data.prepare import main as prepare

    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 80}) + "\n"
                            for i in range(40)))
    assert prepare([str(docs), "--output", str(root / "data"), "--workers", "1"]) == 0
    return root / "data"


def _break(folder: Path, how: str) -> str:
    """Damage a copy of the prepared corpus; returns what the error must name."""
    manifest = json.loads((folder / "manifest.json").read_text())
    shard = folder / manifest["shards"][0]["tokens"]
    docs = folder / manifest["shards"][0]["docs"]
    if how == "manifest_not_json":
        (folder / "manifest.json").write_text("{oops")
        return "manifest.json"
    if how == "manifest_incomplete":
        (folder / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
        return "manifest.json"
    if how == "manifest_missing_field":
        (folder / "manifest.json").write_text(json.dumps(
            {k: v for k, v in manifest.items() if k != "shards"}))
        return "data.dataset"
    if how == "shard_missing":
        shard.unlink()
        return shard.name
    if how == "shard_truncated":
        shard.write_bytes(shard.read_bytes()[:100])
        return shard.name
    if how == "shard_empty":
        shard.write_bytes(b"")
        return shard.name
    if how == "docs_missing":
        docs.unlink()
        return docs.name
    if how == "docs_corrupt":
        docs.write_bytes(b"not a numpy file")
        return "data.dataset"
    raise AssertionError(how)


DATA = ["manifest_not_json", "manifest_incomplete", "manifest_missing_field", "shard_missing",
        "shard_truncated", "shard_empty", "docs_missing", "docs_corrupt"]


@pytest.mark.parametrize("how", DATA)
def test_bad_data(capsys, prepared, tmp_path, how):
    folder = tmp_path / "data"
    shutil.copytree(prepared, folder)
    name = _break(folder, how)
    run_dir = tmp_path / "run"
    _assert_one_line(*_run(capsys, [f"run.dir={run_dir}", f"data.dataset={folder}"]), name)
    assert not run_dir.exists()


def test_validation_without_a_split(capsys, prepared, tmp_path):
    """eval.every on a corpus prepared without --val-fraction names the flag to prepare one."""
    run_dir = tmp_path / "run"
    rc, err = _run(capsys, [f"run.dir={run_dir}", f"data.dataset={prepared}", "eval.every=2"])
    _assert_one_line(rc, err, "--val-fraction")
    assert not run_dir.exists()


def test_corpus_shorter_than_one_window(capsys, prepared, tmp_path):
    run_dir = tmp_path / "run"
    rc, err = _run(capsys, [f"run.dir={run_dir}", f"data.dataset={prepared}",
                            "data.seq_len=100000"])
    _assert_one_line(rc, err, "data.seq_len")
    assert not run_dir.exists()


@pytest.mark.parametrize("content", ['{"version": "1.0"}', "not json at all"],
                         ids=["json_not_tokenizer", "not_json"])
def test_a_tokenizer_file_that_is_not_one(capsys, tmp_path, content):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(content)
    run_dir = tmp_path / "run"
    _assert_one_line(*_run(capsys, [f"run.dir={run_dir}", f"data.tokenizer={tok}"]),
                     "data.tokenizer")
    assert not run_dir.exists()


@pytest.mark.parametrize("override, name", [
    ("model.intermediate_size=256", "model.intermediate_size"), ("optim=muon", "optim=muon")])
def test_a_run_directory_of_another_model_or_optimizer(capsys, tmp_path, override, name):
    """The run directory's newest checkpoint was written by the debug model with AdamW."""
    from dataclasses import asdict

    from model.config import load_model_config

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    state = {"step": 2, "model_config": asdict(load_model_config("debug")), "optim_name": "adamw"}
    (ckpt / "train_state.json").write_text(json.dumps(state))
    before = sorted(p.name for p in run_dir.rglob("*"))
    _assert_one_line(*_run(capsys, [f"run.dir={run_dir}", override]), name)
    assert sorted(p.name for p in run_dir.rglob("*")) == before

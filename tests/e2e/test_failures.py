"""Bad input fails in one line without writing; a crash mid-checkpoint loses nothing published."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import losses, pretrain, pretrain_concurrently

BAD_CONFIGS = [
    ("data.global_batch=7", "data.global_batch"),
    ("parallel.tp=3", "parallel.tp"),
    ("parallel.ep=2", "parallel.ep"),
    ("train.stepz=3", "train.stepz"),
    ("model.num_experts_per_token=99", "num_experts_per_token"),
    ("optim.schedule=linear", "optim.schedule"),
    ("data.dataset=/nonexistent/dir", "data.dataset"),
]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """All bad-config launches at once (each is mostly interpreter start-up)."""
    root = tmp_path_factory.mktemp("bad")
    dirs = {o: root / f"run{i}" for i, (o, _) in enumerate(BAD_CONFIGS)}
    results = pretrain_concurrently(*((d, [o], {"check": False}) for o, d in dirs.items()))
    return {o: (r, dirs[o]) for o, r in zip(dirs, results, strict=True)}


@pytest.mark.parametrize("override, field", BAD_CONFIGS)
def test_bad_config_is_one_line_and_writes_nothing(bad_runs, override, field):
    r, run_dir = bad_runs[override]
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], r.stderr
    assert not run_dir.exists()


def test_missing_cluster_is_one_line(tmp_path):
    import subprocess
    import sys

    from tests.helpers.runs import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "+cluster=local_cpu" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train.steps=4", "checkpoint.interval=2"]
    r = pretrain(run_dir, *args, env={"K3TRAIN_FAULT": "before_publish:4"}, check=False)
    assert r.returncode != 0  # SIGKILL while step 4's shards were written, before publishing
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step-00000004", "step-00000002"]
    pretrain(run_dir, *args)  # the same command resumes from step 2 and ignores the partial
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004"]
    state = json.loads((ckpts / "step-00000004" / "train_state.json").read_text())
    assert state["step"] == 4
    ref = tmp_path / "ref"
    pretrain(ref, *args)
    assert losses(run_dir) == losses(ref)


def test_resume_refuses_a_different_model(tmp_path):
    run_dir = tmp_path / "run"
    pretrain(run_dir, "train.steps=2", "checkpoint.interval=2")
    r = pretrain(run_dir, "train.steps=4", "model.moe_intermediate_size=64", check=False)
    assert r.returncode == 2
    assert "different model" in r.stderr and "moe_intermediate_size" in r.stderr

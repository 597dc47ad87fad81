"""A non-finite loss or gradient on one rank skips the step on every rank (issue #18 item 3):
no parameter, router bias or LR change, routing statistics of the step dropped, the batch
consumed, `skipped_steps` and the offending rank in metrics.jsonl; NaN router scores do not
crash Quantile Balancing; too many in a row stop the run with one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.runs import metrics, pretrain, pretrain_many

INJECT = ("debug.inject_nonfinite=[{step: 3, rank: 1, where: activation},"
          " {step: 5, rank: 0, where: grad}]")
COMMON = ["train.steps=6", "checkpoint.interval=1", "checkpoint.keep=10"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    hit, clean = root / "hit", root / "clean"
    pretrain_many([(hit, [*COMMON, INJECT]), (clean, COMMON)], nproc=2)
    return hit, clean


def _state(run_dir, step):
    from train.checkpoint.export_hf import load_model

    model, _ = load_model(run_dir / "checkpoints" / f"step-{step:08d}")
    return {k: v for k, v in model.state_dict().items() if v.is_floating_point()}


def test_skipped_steps_change_nothing(runs):
    hit, clean = runs
    rows = {m["step"]: m for m in metrics(hit)}
    assert [rows[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert rows[3]["skipped_ranks"] == [1] and rows[5]["skipped_ranks"] == [0]
    assert "skipped_ranks" not in rows[4]
    assert rows[4]["lr"] == rows[3]["lr"] and rows[6]["lr"] == rows[5]["lr"]  # LR held
    ref = {m["step"]: m for m in metrics(clean)}
    assert rows[2]["loss"] == ref[2]["loss"] and rows[4]["lr"] == ref[3]["lr"]
    for before, after in ((2, 3), (4, 5)):
        a, b = _state(hit, before), _state(hit, after)
        biases = [k for k in a if k.endswith("e_score_correction_bias")]
        assert biases and all(torch.equal(a[k], b[k]) for k in a), (before, after)
    moved = _state(hit, 4)
    assert any(not torch.equal(moved[k], v) for k, v in _state(hit, 3).items())
    # the batch was consumed: step 4 trains on the clean run's step-4 samples
    assert rows[4]["sample_ids"] == ref[4]["sample_ids"]


def test_too_many_in_a_row_stop_with_one_line(tmp_path):
    r = pretrain(tmp_path / "run", "train.steps=5", "checkpoint.interval=1",
                 "debug.inject_nonfinite_steps=[2,3]", "train.max_skipped_in_a_row=2",
                 check=False)
    assert r.returncode == 3, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "train.max_skipped_in_a_row=2" in err[0], r.stderr[-2000:]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts[-1] == "step-00000002"  # nothing written after the run gave up
    # the count a resume continues from
    state = json.loads((tmp_path / "run" / "checkpoints" / ckpts[-1] / "train_state.json")
                       .read_text())
    assert state["skipped_steps"] == 1

"""End-to-end `optim=muon` (Per-Head Muon + AdamW, QK-Clip at tau=100) under the real launcher:
the loss falls, QK-Clip's metrics are logged every step, a run stopped at step 8 and resumed
by the same command repeats the straight run's losses bit for bit (Muon's momentum and AdamW's
moments through DCP), FSDP, pipeline, tensor and expert parallel layouts equal one rank
(fp64, QK-Clip active), and a one-rank checkpoint resumes on FSDP over 2 ranks with the same
losses."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.runs import (
    assert_parameters_equal,
    losses,
    metrics,
    pretrain,
    pretrain_concurrently,
)

STEPS = ["optim=muon", "train.steps=12", "checkpoint.interval=4"]


# fp64 verification runs; tau 2 makes QK-Clip rescale heads every step (the debug model's
# logit bounds are ~3-6), so the layouts check it too
FP64 = ["optim=muon", "train.steps=3", "checkpoint.interval=3", "cluster.param_dtype=fp64",
        "optim.qk_clip_tau=2.0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    straight, stopped, one = root / "straight", root / "stopped", root / "one"
    pretrain_concurrently((straight, STEPS), (stopped, [*STEPS, "train.stop_at_step=8"]),
                          (one, FP64))
    first = losses(stopped)
    pretrain(stopped, *STEPS)  # the same command: resumes from step 8
    return {"straight": straight, "stopped": stopped, "first": first, "one": one}


def test_muon_trains_and_logs_qk_clip(runs):
    loss = losses(runs["straight"])
    assert sorted(loss) == list(range(1, 13)) and loss[12] < loss[1] - 0.5, loss
    for m in metrics(runs["straight"]):
        assert isinstance(m["qk_clipped_heads"], int) and m["qk_clipped_heads"] >= 0
        assert m["attn_logit_max"] is not None and len(m["attn_logit_max_per_layer"]) == len(
            m["mla_layer_ids"]) > 0
        assert m["attn_logit_max"] == max(m["attn_logit_max_per_layer"])


def test_muon_resume_is_bit_identical(runs):
    a, b = losses(runs["straight"]), losses(runs["stopped"])
    assert sorted(runs["first"]) == list(range(1, 9)) and sorted(b) == list(range(1, 13))
    for s in range(1, 13):
        assert b[s] == a[s], (s, a[s], b[s])


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.pp=2"],
                                    ["parallel.tp=2"], ["parallel.ep=2"]])
def test_muon_layouts_equal_one_rank(runs, tmp_path, layout):
    """fp64 verification mode, 3 steps: losses, gradient norms, QK-Clip's clipped heads and
    parameters of 2 ranks (FSDP over 2: the owner exchange; 2 pipeline stages; tensor parallel
    2: per-head blocks local, column-sharded matrices gathered; expert parallel 2) equal one
    rank's."""
    one, two = runs["one"], tmp_path / "two"
    pretrain(two, *FP64, *layout, nproc=2)
    ref, got = metrics(one), metrics(two)
    for r, g in zip(ref, got, strict=True):
        assert abs(g["loss"] - r["loss"]) <= 1e-9 * abs(r["loss"]), (r, g)
        assert abs(g["grad_norm"] - r["grad_norm"]) <= 1e-6 * r["grad_norm"], (r, g)
        assert g["qk_clipped_heads"] == r["qk_clipped_heads"] > 0
    assert len(assert_parameters_equal(one, two, 3)) > 50


def test_muon_checkpoint_resumes_under_another_layout(runs, tmp_path):
    """The one-rank fp64 checkpoint of step 3 continued for 2 steps on FSDP over 2 ranks equals
    continuing it on one rank: Muon's momentum (a DTensor like its parameter) reshards."""
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(runs["one"], one)
    shutil.copytree(runs["one"], two)
    longer = [a for a in FP64 if not a.startswith("train.steps")] + ["train.steps=5"]
    pretrain(one, *longer)
    pretrain(two, *longer, "parallel.dp_shard=2", nproc=2)
    ref, got = losses(one), losses(two)
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5]
    for s in (4, 5):
        assert abs(got[s] - ref[s]) <= 1e-9 * abs(ref[s]), (s, ref[s], got[s])
    assert len(assert_parameters_equal(one, two, 5)) > 50

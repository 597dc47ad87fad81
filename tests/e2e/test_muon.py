"""End-to-end `optim=muon` (Per-Head Muon + AdamW, QK-Clip) under the real launcher, in the
fp64 verification mode with tau 2 so that QK-Clip rescales heads every step (the debug model's
logit bounds are ~3-6): one rank trains (loss falls, QK-Clip's metrics logged); FSDP over 2
ranks (the owner exchange), 2 pipeline stages, tensor parallel 2 and expert parallel 2 give the
same losses, gradient norms, clipped heads and parameters; its step-3 checkpoint resumes on one
rank bit for bit and on FSDP over 2 ranks to the same losses and parameters (Muon's momentum
and AdamW's moments through DCP)."""

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

FP64 = ["optim=muon", "train.steps=5", "checkpoint.interval=3", "cluster.param_dtype=fp64",
        "optim.qk_clip_tau=2.0"]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    run = tmp_path_factory.mktemp("muon") / "one"
    pretrain(run, *FP64)
    return run


def _close(got: dict, ref: dict) -> None:
    assert abs(got["loss"] - ref["loss"]) <= 1e-9 * abs(ref["loss"]), (ref, got)
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-6 * ref["grad_norm"], (ref, got)
    assert got["qk_clipped_heads"] == ref["qk_clipped_heads"] > 0, (ref, got)


def test_muon_trains_and_logs_qk_clip(one):
    loss = losses(one)
    assert sorted(loss) == [1, 2, 3, 4, 5] and loss[5] < loss[1] - 0.2, loss
    for m in metrics(one):
        assert isinstance(m["qk_clipped_heads"], int) and m["qk_clipped_heads"] > 0
        assert len(m["attn_logit_max_per_layer"]) == len(m["mla_layer_ids"]) > 0
        assert m["attn_logit_max"] == max(m["attn_logit_max_per_layer"])


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.pp=2"],
                                    ["parallel.tp=2"], ["parallel.ep=2"]])
def test_muon_layouts_equal_one_rank(one, tmp_path, layout):
    """2 ranks: FSDP over 2 (the owner exchange), 2 pipeline stages, tensor parallel 2 (per-head
    blocks local, column-sharded matrices gathered), expert parallel 2."""
    two = tmp_path / "two"
    pretrain(two, *FP64, *layout, nproc=2)
    for r, g in zip(metrics(one), metrics(two), strict=True):
        _close(g, r)
    assert len(assert_parameters_equal(one, two, 5)) > 50


def test_muon_checkpoint_resumes_on_one_rank_and_on_fsdp(one, tmp_path):
    """Step 3's checkpoint continued to step 5 on one rank repeats the straight run bit for
    bit; on FSDP over 2 ranks (momentum resharded) it gives the same losses and parameters."""
    same, other = tmp_path / "same", tmp_path / "other"
    for d in (same, other):  # the run as it was at step 3 (the logger drops later lines)
        shutil.copytree(one, d)
        shutil.rmtree(d / "checkpoints" / "step-00000005")
    pretrain_concurrently((same, FP64), (other, [*FP64, "parallel.dp_shard=2"], {"nproc": 2}))
    ref = losses(one)
    assert losses(same) == ref
    got = metrics(other)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    for r, g in zip(metrics(one)[3:], got[3:]):
        _close(g, r)
    assert len(assert_parameters_equal(one, other, 5)) > 50


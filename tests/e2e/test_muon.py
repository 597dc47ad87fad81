"""End-to-end `optim=muon` (Per-Head Muon + AdamW, QK-Clip) under the real launcher, in the
fp64 verification mode with tau 2 so that QK-Clip rescales heads every step (the debug model's
logit bounds are ~3-6): one rank trains (loss falls, QK-Clip's metrics logged); layouts on
4 ranks (dp 4; tp 2 x dp 2 with ep 4; pp 2 x dp 2) and tp 2 alone give the same losses,
gradient norms, clipped heads and parameters; step-3 checkpoints resume on one rank, bit for
bit from one rank's and to the same numbers from tp 2 x dp 2 x ep 4's (Muon's momentum and
AdamW's moments resharded through DCP)."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.runs import (
    assert_parameters_equal,
    losses,
    metrics,
    pretrain,
    pretrain_concurrently,
    pretrain_many,
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


LAYOUTS = {  # 3 steps each
    # FSDP x TP with the experts over ep 4 (borrowing the tp ranks): per-head blocks and experts
    # local, the matrices TP splits on owners that join only TP's shards, tp-replicated ones on
    # owners
    "tp2_dp2_ep4": (["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=4"], 4),
    "dp4": (["parallel.dp_shard=4"], 4),  # FSDP over 4: the owner exchange
    "pp2_dp2": (["parallel.pp=2", "parallel.dp_shard=2"], 4),  # 2 stages x FSDP 2
    # tensor parallel alone: row-split matrices on owners over tp, column-split ones gathered
    "tp2": (["parallel.tp=2"], 2),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    for nproc in (4, 2):  # one launch per world size
        pretrain_many([(root / name, [*FP64, "train.stop_at_step=3", *extra])
                       for name, (extra, n) in LAYOUTS.items() if n == nproc], nproc=nproc)
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layouts_equal_one_rank(one, layouts, name):
    """Experts 2-D sharded over expert FSDP x ep stay local (`tests/unit/test_muon.py` pins
    the route; their update is the local path every layout here takes)."""
    got = metrics(layouts[name])
    assert len(got) == 3
    for r, g in zip(metrics(one), got):
        _close(g, r)
    assert len(assert_parameters_equal(one, layouts[name], 3)) > 50


def test_muon_checkpoint_resumes_on_one_rank(one, layouts, tmp_path):
    """Step 3's checkpoint continued to step 5 on one rank repeats the straight run bit for
    bit; tp 2 x dp 2 x ep 4's step-3 checkpoint (Muon's momentum and AdamW's moments 2-D
    sharded) continued on one rank gives the same losses and parameters."""
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(one, same)  # the run as it was at step 3
    shutil.rmtree(same / "checkpoints" / "step-00000005")
    shutil.copytree(layouts["tp2_dp2_ep4"], other)  # stopped at step 3
    pretrain_concurrently((same, FP64), (other, FP64))
    ref = losses(one)
    assert losses(same) == ref
    got = metrics(other)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    for r, g in zip(metrics(one)[3:], got[3:]):
        _close(g, r)
    assert len(assert_parameters_equal(one, other, 5)) > 50

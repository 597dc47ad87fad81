"""End-to-end `optim=muon` (Per-Head Muon + AdamW, QK-Clip at tau=100) under the real launcher:
the loss falls, QK-Clip's metrics are logged every step, a run stopped at step 8 and resumed
by the same command repeats the straight run's losses bit for bit (Muon's momentum and AdamW's
moments through DCP), and a multi-rank launch is refused with a one-line error."""

from __future__ import annotations

import pytest

from tests.helpers.runs import losses, metrics, pretrain, pretrain_concurrently

STEPS = ["optim=muon", "train.steps=12", "checkpoint.interval=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    straight, stopped = root / "straight", root / "stopped"
    pretrain_concurrently((straight, STEPS), (stopped, [*STEPS, "train.stop_at_step=8"]))
    first = losses(stopped)
    pretrain(stopped, *STEPS)  # the same command: resumes from step 8
    return {"straight": straight, "stopped": stopped, "first": first}


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


def test_muon_on_two_ranks_is_refused(tmp_path):
    r = pretrain(tmp_path / "two", *STEPS, nproc=2, check=False)
    assert r.returncode != 0
    assert "optim=muon runs on one rank so far" in r.stderr

"""Checkpoint integrity (issue #18 item 2): every checkpoint records the size and SHA-256 of its
files; a missing, truncated or altered file is named in one line and that checkpoint skipped for
the previous one; a save that fails on one rank (an injected ENOSPC) leaves no temporary or
half-published directory and training goes on, saving again at the next interval."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.runs import losses, pretrain
from train.checkpoint.checkpointer import CHECKSUMS, Checkpointer

RUN = ["train.steps=3", "checkpoint.interval=1", "checkpoint.keep=10"]


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory):
    """2 ranks, 3 steps, the step-2 save fails on rank 1 as on a full disk."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    r = pretrain(run, *RUN, nproc=2, env={"K3TRAIN_FAULT": "enospc:2"})
    return run, r


def test_a_failed_save_is_dropped_and_training_goes_on(full_disk_run):
    run, r = full_disk_run
    warn = [line for line in r.stdout.splitlines() if "not saved" in line]
    assert len(warn) == 1 and "step-00000002" in warn[0] and "No space left" in warn[0]
    assert "step-00000001 is intact" in warn[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000001", "step-00000003"]  # no .tmp-*, nothing half-published
    assert sorted(losses(run)) == [1, 2, 3]
    assert "checkpoint step-00000002 saved" not in r.stdout


def _damage(ckpt, how: str) -> str:
    shard = ckpt / "__1_0.distcp"
    if how == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return "__1_0.distcp is truncated"
    if how == "altered":  # same size, one byte flipped
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0xFF
        shard.write_bytes(bytes(data))
        return "__1_0.distcp is corrupted"
    if how == "missing":
        (ckpt / ".metadata").unlink()
        return ".metadata is missing"
    (ckpt / CHECKSUMS).write_text("{not json")
    return f"{CHECKSUMS} is not valid JSON"


@pytest.mark.parametrize("how", ["truncated", "altered", "missing", "bad_record"])
def test_damaged_checkpoints_are_named_and_skipped(full_disk_run, tmp_path, how):
    run, _ = full_disk_run
    root = tmp_path / "checkpoints"
    shutil.copytree(run / "checkpoints", root)
    ckpts = Checkpointer(root, keep=10, rank=0)
    assert ckpts.problem(root / "step-00000003") is None
    expected = _damage(root / "step-00000003", how)
    logged: list[str] = []
    assert ckpts.latest_intact(logged.append) == root / "step-00000001"
    assert len(logged) == 1 and "step-00000003" in logged[0] and expected in logged[0], logged


def test_resume_skips_a_damaged_checkpoint_and_matches(full_disk_run, tmp_path):
    """The newest checkpoint truncated: the run resumes from step 1 and its losses equal the
    uninterrupted run's, bit for bit (same layout)."""
    run, _ = full_disk_run
    again = tmp_path / "run"
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("metrics.jsonl"))
    _damage(again / "checkpoints" / "step-00000003", "truncated")
    r = pretrain(again, *RUN, nproc=2)
    assert "step-00000003 is damaged (__1_0.distcp is truncated" in r.stdout
    got, ref = losses(again), losses(run)
    assert sorted(got) == [2, 3] and all(got[s] == ref[s] for s in got)

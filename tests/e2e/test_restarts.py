"""Automatic restart under torchrun (issue #18 item 1), and the straggler detector (item 4).

One 2-rank `torchrun --max-restarts=4` job with asynchronous saves on CPU is killed (SIGKILL of a
single rank, `train.crash_faults`) four times: mid-forward, mid-backward, inside an asynchronous
checkpoint write, and at a seeded random moment. torchrun restarts the worker group each time;
it resumes from the last intact checkpoint and ends with every step's loss and samples equal,
bit for bit, to an uninterrupted run. The uninterrupted run has rank 1 slowed in its forward
(`debug.slow_rank`): the detector names rank 1 and no other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.runs import FAST, ROOT, metrics

ARGS = ["train.steps=8", "checkpoint.interval=2", "checkpoint.async_save=true",
        "cluster.timeout_s=60"]
FAULTS = "forward:4:1@0,backward:6:0@1,async_write:6:1@2,random:7:0@3"
SLOW = ["debug.slow_rank=1", "debug.slow_rank_s=0.3", "train.straggler_steps=3"]


def _torchrun(run_dir, overrides, restarts=0, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", str(ROOT / "launch" / "pretrain.py"),
           "+cluster=local_cpu", f"run.dir={run_dir}", *FAST, *ARGS, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("restarts")
    log = root / "faults.jsonl"
    with ThreadPoolExecutor(2) as pool:
        ref = pool.submit(_torchrun, root / "ref", SLOW)
        got = pool.submit(_torchrun, root / "killed", [], 4,
                          {"K3TRAIN_FAULT": FAULTS, "K3TRAIN_FAULT_LOG": str(log)})
        ref, got = ref.result(), got.result()
    for r in (ref, got):
        assert r.returncode == 0, r.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return root, ref, got, events


def test_four_kills_restart_and_change_nothing(runs):
    root, _, got, events = runs
    kills = [e for e in events if e["event"] == "kill"]
    assert [(e["point"], e["attempt"]) for e in kills] == [
        ("forward", 0), ("backward", 1), ("async_write", 2), ("random", 3)]
    starts = {(e["attempt"], e["rank"]) for e in events if e["event"] == "start"}
    assert starts == {(a, r) for a in range(5) for r in range(2)}
    assert "resumed from step-" in got.stdout and "torchrun restart" in got.stdout
    ref, mine = metrics(root / "ref"), metrics(root / "killed")
    assert [m["step"] for m in mine] == list(range(1, 9))  # no step lost or repeated
    for r, g in zip(ref, mine, strict=True):
        assert g["loss"] == r["loss"] and g["grad_norm"] == r["grad_norm"], g["step"]
        assert g["sample_ids"] == r["sample_ids"]
    for kill in kills:  # every kill was followed by a restarted group (no timing bound)
        assert any(e["event"] == "start" and e["attempt"] == kill["attempt"] + 1
                   and e["time"] > kill["time"] for e in events)


def test_the_slow_rank_is_named(runs):
    root, ref, _, _ = runs
    lines = [ln for ln in ref.stdout.splitlines() if "is a straggler" in ln]
    assert lines and all(ln.startswith("warning: rank 1 ") for ln in lines), ref.stdout[-2000:]
    m = metrics(root / "ref")
    assert all(x["step_compute_slowest_rank"] == 1 for x in m)

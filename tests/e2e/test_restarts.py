"""Automatic restart under torchrun (issue #18 item 1), and the straggler detector (item 4).

One 2-rank `torchrun --max-restarts=4` job with asynchronous saves on CPU is killed (SIGKILL of a
single rank, `train.faults.crash`) four times: mid-forward, mid-backward, inside an asynchronous
checkpoint write, and at a seeded random moment. torchrun restarts the worker group each time; it
resumes from the last intact checkpoint and ends with every step's loss and samples equal, bit for
bit, to an uninterrupted run. The same job on two torchrun agents (`--nnodes=2`, one worker each,
c10d rendezvous on localhost, as two nodes would run it) has one "node"'s worker killed mid-forward:
both agents restart their workers and the run ends equal to the uninterrupted one. The uninterrupted
run has rank 1 slowed in its forward (`debug.slow_rank`): the detector names rank 1 and no other."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.runs import FAST, ROOT, metrics

ARGS = ["train.steps=8", "checkpoint.interval=2", "checkpoint.async_save=true",
        "cluster.timeout_s=60"]
FAULTS = "forward:4:1@0,backward:6:0@1,async_write:6:1@2,random:7:0@3"
NODE_FAULT = "forward:5:1@0"  # the worker of "node" 1
# Rank 1 sleeps 1.5 s per micro-batch (3 s a step) against ~0.5-2 s of compute per rank while
# this job shares the CPU with the two others: 0.3 s (0.6 s a step) left rank 1 only 1.2x rank 0
# at some steps here and missed the 3-step streak on CI's 2 cores.
SLOW = ["debug.slow_rank=1", "debug.slow_rank_s=1.5", "train.straggler_factor=1.3",
        "train.straggler_steps=3"]


def _torchrun(run_dir, overrides, restarts=0, env=None, agent=("--standalone",
                                                                   "--nproc_per_node=2")):
    cmd = [sys.executable, "-m", "torch.distributed.run", *agent, f"--max-restarts={restarts}",
           str(ROOT / "launch" / "pretrain.py"), "+cluster=local_cpu", f"run.dir={run_dir}",
           *FAST, *ARGS, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _two_nodes(run_dir, log):
    """Two torchrun agents of one worker each, meeting at a c10d rendezvous on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = ("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
             f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=k3train_two_nodes")
    env = {"K3TRAIN_FAULT": NODE_FAULT, "K3TRAIN_FAULT_LOG": str(log)}
    with ThreadPoolExecutor(2) as pool:
        nodes = [pool.submit(_torchrun, run_dir, [], 2, env, agent) for _ in range(2)]
        return [n.result() for n in nodes]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("restarts")
    log, node_log = root / "faults.jsonl", root / "node_faults.jsonl"
    with ThreadPoolExecutor(3) as pool:
        ref = pool.submit(_torchrun, root / "ref", SLOW)
        got = pool.submit(_torchrun, root / "killed", [], 4,
                          {"K3TRAIN_FAULT": FAULTS, "K3TRAIN_FAULT_LOG": str(log)})
        nodes = pool.submit(_two_nodes, root / "two_nodes", node_log)
        ref, got, nodes = ref.result(), got.result(), nodes.result()
    for r in (ref, got, *nodes):
        assert r.returncode == 0, r.stderr[-4000:]
    return root, ref, got, _events(log), _events(node_log), nodes


def _events(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def _assert_equal_to_ref(root, name):
    ref, mine = metrics(root / "ref"), metrics(root / name)
    assert [m["step"] for m in mine] == list(range(1, 9))  # no step lost or repeated
    for r, g in zip(ref, mine, strict=True):
        assert g["loss"] == r["loss"] and g["grad_norm"] == r["grad_norm"], (name, g["step"])
        assert g["sample_ids"] == r["sample_ids"]


def test_four_kills_restart_and_change_nothing(runs):
    root, _, got, events, _, _ = runs
    kills = [e for e in events if e["event"] == "kill"]
    assert [(e["point"], e["attempt"]) for e in kills] == [
        ("forward", 0), ("backward", 1), ("async_write", 2), ("random", 3)]
    starts = {(e["attempt"], e["rank"]) for e in events if e["event"] == "start"}
    assert starts == {(a, r) for a in range(5) for r in range(2)}
    assert "resumed from step-" in got.stdout and "torchrun restart" in got.stdout
    _assert_equal_to_ref(root, "killed")
    for kill in kills:  # every kill was followed by a restarted group (no timing bound)
        assert any(e["event"] == "start" and e["attempt"] == kill["attempt"] + 1
                   and e["time"] > kill["time"] for e in events)


def test_a_lost_node_restarts_both_nodes(runs):
    root, _, _, _, events, nodes = runs
    assert [(e["rank"], e["attempt"]) for e in events if e["event"] == "kill"] == [(1, 0)]
    # the agent of "node" 0 lost no worker, yet restarted its own with the other's
    starts = {(e["attempt"], e["rank"]) for e in events if e["event"] == "start"}
    assert starts == {(a, r) for a in range(2) for r in range(2)}
    nodes_stdout = "".join(r.stdout for r in nodes)  # rank 0 is on either agent
    assert "resumed from step-" in nodes_stdout and "(torchrun restart 1)" in nodes_stdout
    _assert_equal_to_ref(root, "two_nodes")


def test_the_slow_rank_is_named(runs):
    root, ref, _, _, _, _ = runs
    lines = [ln for ln in ref.stdout.splitlines() if "is a straggler" in ln]
    assert lines and all(ln.startswith("warning: rank 1 ") for ln in lines), ref.stdout[-2000:]
    m = metrics(root / "ref")
    assert all(x["step_compute_slowest_rank"] == 1 for x in m)

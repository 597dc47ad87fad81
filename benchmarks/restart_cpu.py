"""Time from a lost rank to a training job that is stepping again, on CPU; prints one JSON line.

    python benchmarks/restart_cpu.py [--nnodes 1|2] [--kill-step 5]

A 2-rank `debug` job under `torchrun --max-restarts=1` (`--nnodes 2`: two agents of one worker
each at a c10d rendezvous on localhost) has rank 1 SIGKILLed mid-forward at `--kill-step`
(`K3TRAIN_FAULT`). From the fault log and metrics.jsonl:
- `detected_s`: kill -> the first agent's "failed (exitcode: N)" line (glog time, ms): the
  killed worker (-9) or a peer whose collective broke (1), whichever the agent saw first;
- `restarted_s`: kill -> the last restarted worker entering the launcher;
- `stepping_s`: kill -> the first step completed after the resume;
- `steps_redone`: steps trained again (those after the resumed checkpoint, before the kill).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["+cluster=local_cpu", "data.seq_len=64", "data.global_batch=8", "data.micro_batch=2",
       "data.stdlib_max_bytes=2000000", "metrics.wandb_mode=disabled", "train.log_images_every=0",
       "checkpoint.interval=2", "cluster.timeout_s=60"]
FAILED = re.compile(r"^E(\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode: -?\d+\)", re.M)


def _agent_args(nnodes: int) -> list[list[str]]:
    if nnodes == 1:
        return [["--standalone", "--nproc_per_node=2"]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
             f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=k3train_bench"]] * 2


def _failure_time(agent_stderr: str, near: float) -> float | None:
    """The glog time of the agent's failure line, as a Unix time (the date taken from `near`)."""
    m = FAILED.search(agent_stderr)
    if not m:
        return None
    day = datetime.datetime.fromtimestamp(near)
    t = datetime.datetime.strptime(f"{day.year}{m[1]}{m[2]} {m[3]}", "%Y%m%d %H:%M:%S.%f")
    return t.timestamp()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nnodes", type=int, choices=(1, 2), default=1)
    ap.add_argument("--kill-step", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, log = Path(tmp) / "run", Path(tmp) / "faults.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "K3TRAIN_FAULT_LOG": str(log),
               "K3TRAIN_FAULT": f"forward:{args.kill_step}:1@0"}
        overrides = [*JOB, f"run.dir={run}", f"train.steps={args.kill_step + 1}"]

        def agent(agent_args: list[str]) -> subprocess.CompletedProcess:
            cmd = [sys.executable, "-m", "torch.distributed.run", *agent_args,
                   "--max-restarts=1", str(ROOT / "launch" / "pretrain.py"), *overrides]
            return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=900)

        with ThreadPoolExecutor(args.nnodes) as pool:
            agents = list(pool.map(agent, _agent_args(args.nnodes)))
        for a in agents:
            if a.returncode != 0:
                sys.exit(f"restart_cpu: the job failed ({a.returncode}):\n{a.stderr[-3000:]}")
        events = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kill = next(e for e in events if e["event"] == "kill")
    restarted = max(e["time"] for e in events if e["event"] == "start" and e["attempt"] == 1)
    after = [m for m in steps if m["time"] > kill["time"]]
    detected = [t for a in agents if (t := _failure_time(a.stderr, kill["time"])) is not None]
    print(json.dumps({
        "bench": "restart_cpu", "nnodes": args.nnodes, "ranks": 2, "kill_step": kill["step"],
        "detected_s": round(min(detected) - kill["time"], 3) if detected else None,
        "restarted_s": round(restarted - kill["time"], 2),
        "stepping_s": round(after[0]["time"] - kill["time"], 2),
        "steps_redone": kill["step"] - after[0]["step"],
        "steps_logged": sorted({m["step"] for m in steps}) == list(range(1, args.kill_step + 2)),
    }))


if __name__ == "__main__":
    main()

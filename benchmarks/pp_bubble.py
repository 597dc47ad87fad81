"""Pipeline bubble of each schedule on CPU: 2 pipeline ranks (one core each) vs one rank.

Runs the real launcher: one rank (gradient accumulation over the same micro-batches), then
pp=2 with each schedule. The bubble estimate is 1 - t_1rank / (pp x t_pp): the fraction of the
pipeline ranks' time not spent on the one-rank work (idle slots plus send/recv overhead).
Prints one JSON line. `python benchmarks/pp_bubble.py [--microbatches 8] [--steps 6]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = {
    "GPipe": [], "1F1B": [],
    "Interleaved1F1B": ["parallel.pp_virtual_stages=2"],
    "LoopedBFS": ["parallel.pp_virtual_stages=2"],
    "InterleavedZeroBubble": ["parallel.pp_virtual_stages=2"],
    "ZBVZeroBubble": ["parallel.pp_virtual_stages=2"],
}


def step_time(run_dir: Path, nproc: int, extra: list[str], args) -> float:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "launch" / "pretrain.py"), "+cluster=local_cpu", f"run.dir={run_dir}",
            f"data.seq_len={args.seq_len}", "data.micro_batch=2",
            f"data.global_batch={2 * args.microbatches}", "data.stdlib_max_bytes=2000000",
            f"train.steps={args.steps}", "checkpoint.enabled=false", "train.log_images_every=0",
            "metrics.wandb_mode=disabled", "metrics.console=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(line)["step_time_s"] for line in lines][1:]  # skip the first step
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    pp = 2
    with tempfile.TemporaryDirectory() as tmp:
        t1 = step_time(Path(tmp, "one"), 1, [], args)
        out = {"pp": pp, "microbatches": args.microbatches, "seq_len": args.seq_len,
               "one_rank_step_s": round(t1, 3),
               "ideal_1f1b_bubble": round((pp - 1) / (args.microbatches + pp - 1), 3)}
        for name, extra in SCHEDULES.items():
            t = step_time(Path(tmp, name), pp,
                          ["parallel.pp=2", f"parallel.pp_schedule={name}", *extra], args)
            out[name] = {"step_s": round(t, 3), "bubble": round(1 - t1 / (pp * t), 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

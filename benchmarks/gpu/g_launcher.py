"""Stage g (launcher): the real launcher under torchrun, one process on one GPU.

    python benchmarks/gpu/g_launcher.py [--device cuda] [--small] [--state FILE]

Runs `torchrun --standalone --nproc_per_node=1 launch/pretrain.py +cluster=gpu_node8
model=k3_small train.steps=2 metrics.wandb_mode=disabled` (as `python -m torch.distributed.run`,
the same program) with seq_len 4096, global/micro batch 1, no checkpoints, no images, 2 MB of the
stdlib corpus and a fresh run.dir under the suite's scratch folder, plus the model overrides
stage f found necessary (`--state`, e.g. fewer layers). `--small` (CPU): +cluster=local_cpu,
model=debug, seq_len 128. Reports the exit code, per-step loss, step time, tokens/s, MFU and
memory from metrics.jsonl, and the output's tail when it failed. `--extra` adds overrides: the
suite's `launcher_compiled` stage runs it with `parallel.compile=true` (every decoder layer one
inductor graph), the check that `parallel.compile` waits for before it becomes a CUDA default.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import gpu_common as common
from f_step import scratch_dir

STEPS = 2


def main(ctx: common.Ctx, out: dict) -> bool:
    model_overrides: list[str] = []
    if ctx.args.state and Path(ctx.args.state).is_file():
        try:
            model_overrides = json.loads(Path(ctx.args.state).read_text())["model_overrides"]
        except (ValueError, KeyError):
            out["state_unreadable"] = ctx.args.state
    run_dir = scratch_dir() / ("launch-run-small" if ctx.small else "launch-run")
    if ctx.args.extra:
        run_dir = run_dir.with_name(run_dir.name + "-extra")
    shutil.rmtree(run_dir, ignore_errors=True)
    if ctx.small:
        job = ["+cluster=local_cpu", "model=debug", "data.seq_len=128", "data.global_batch=2",
               "data.micro_batch=1"]
    else:
        job = ["+cluster=gpu_node8", "model=k3_small", "data.seq_len=4096",
               "data.global_batch=1", "data.micro_batch=1"]
    job += [f"train.steps={STEPS}", "metrics.wandb_mode=disabled", "checkpoint.enabled=false",
            "train.log_images_every=0", "data.stdlib_max_bytes=2000000", f"run.dir={run_dir}",
            *model_overrides, *ctx.args.extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(common.ROOT / "launch" / "pretrain.py"), *job]
    out["command"] = " ".join(["torchrun", *cmd[3:]])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "8")}
    rc, so, se, timed_out = common.run_child(cmd, ctx.left() - 5, env=env)
    out.update(rc=rc, timed_out=timed_out, model_overrides=model_overrides,
               extra=list(ctx.args.extra))
    lines = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    keys = ("step", "loss", "grad_norm", "step_time_s", "tokens_per_sec", "mfu", "max_mem_gib",
            "expert_load_max_over_mean")
    out["steps"] = [{k: m.get(k) for k in keys} for m in lines]
    out["losses"] = [m.get("loss") for m in lines]
    out["step_times_s"] = [m.get("step_time_s") for m in lines]
    finite = all(isinstance(x, (int, float)) and math.isfinite(x) for x in out["losses"])
    out["losses_finite"] = finite and bool(lines)
    ok = rc == 0 and len(lines) == STEPS and finite
    if not ok:
        out["stdout_tail"] = common.tail(so, 10)
        out["stderr_tail"] = common.tail(se, 25)
    else:
        out["log_tail"] = common.tail(so, 4, 800)
    return ok


def extra(ap) -> None:
    ap.add_argument("--state", default=None, help="stage f's state file (model overrides)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides, e.g. "
                    "parallel.compile=true")


if __name__ == "__main__":
    common.run_stage("launcher", main, extra)

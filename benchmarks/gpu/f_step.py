"""Stage f (step): k3_small training steps on one GPU through the real config and trainer code.

    python benchmarks/gpu/f_step.py [--device cuda] [--small] [--state FILE]

The job is composed like the launcher does (`launch.pretrain.load_job`: Hydra compose, then
`validate_job`) with `+cluster=gpu_node8` (NCCL, bf16 parameters, fp32 gradient reduction),
`model=k3_small`, seq_len 4096, micro_batch 1, global_batch 1, the embedded stdlib corpus (2 MB
of it), W&B disabled, no checkpoints; a 1-rank NCCL process group starts in-process
(`train.distributed.init_distributed`); then the trainer's own pieces: `ParallelDims`, meshes,
the trainer's loader, `parallelize`, `build_optimizer`, and `train.trainer.train_step` per step
(followed by `balance_routers`, as `train()` does).

Steps 1-3 run under `torch.cuda.set_sync_debug_mode("warn")` with `warnings.simplefilter
("always")`: each sync warning is counted and attributed to the first frame outside torch (a
sync inside autograd's C++ backward shows at the `.backward()` call). Step 3 also runs the
trainer's host-sync counter (`SyncCounts`: `host_syncs_model`, `host_syncs_step`, by op). Step 4
is a clean timed step (tokens/s, MFU). Step 5 runs under torch.profiler (CPU + CUDA): GPU time
is split into GEMM kernels (names with gemm/cutlass/sm90/nvjet/matmul), attention kernels
(flash/fmha/attn, counted before GEMM since FlashAttention-3 names contain cutlass/sm90), other
kernels (incl. memcpy/memset, NCCL) and idle (step wall time minus the union of kernel busy
intervals); the 12 most expensive kernels are listed.

Memory: parameters fp32 + gradients fp32 + AdamW's two fp32 states + bf16 compute copies +
AdamW temporaries are estimated at 22 bytes per parameter plus ~16 GiB of activations; if that
exceeds 90% of the GPU, or the first attempt runs out of memory, the model is reduced to 10
layers (`model.num_hidden_layers=10 model.full_attn_layers=[4,8]`) and the JSON says so
("reduced": true). Each attempt is a child process; the overrides that ran are written to
`--state` for stage g. `--small` (CPU): +cluster=local_cpu, model=debug, seq_len 128, global
batch 2 of micro-batches of 1 (gradient accumulation), gloo; the same code path otherwise.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import gpu_common as common
import torch

REDUCED = ["model.num_hidden_layers=10", "model.full_attn_layers=[4,8]"]
GEMM_KEYS = ("gemm", "cutlass", "sm90", "nvjet", "matmul")
ATTN_KEYS = ("flash", "fmha", "attn")
BYTES_PER_PARAM = 22
ACTIVATION_GIB = 16


def scratch_dir() -> Path:
    base = Path(os.environ.get("K3_GPU_SUITE_TMP") or Path(tempfile.gettempdir()) / "k3_gpu_suite")
    base.mkdir(parents=True, exist_ok=True)
    return base


def job_overrides(small: bool, run_dir: Path, model_overrides: list[str]) -> list[str]:
    common_ = ["checkpoint.enabled=false", "metrics.wandb_mode=disabled",
               "train.log_images_every=0", "data.stdlib_max_bytes=2000000",
               "train.steps=100", f"run.dir={run_dir}"]
    if small:
        return ["+cluster=local_cpu", "model=debug", "data.seq_len=128", "data.global_batch=2",
                "data.micro_batch=1", *common_, *model_overrides]
    return ["+cluster=gpu_node8", "model=k3_small", "data.seq_len=4096", "data.global_batch=1",
            "data.micro_batch=1", *common_, *model_overrides]


# ----------------------------------------------------------------------------- sync warnings
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_HOOK_FILES = ("/warnings.py", "gpu_common.py", "f_step.py", "contextlib.py")


def _site(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(first frame outside torch, innermost frame) as 'file:line func', innermost first,
    after dropping the frames of the warning machinery and of this suite."""
    frames = [f for f in stack if not any(h in f.filename for h in _HOOK_FILES)]
    if not frames:
        return "?", "?"
    inner = frames[-1]
    via = f"{common._short(inner.filename)}:{inner.lineno} {inner.name}"
    for f in reversed(frames):
        path = str(Path(f.filename).resolve()) if f.filename.startswith("/") else f.filename
        if not path.startswith(_TORCH_DIR):
            return f"{common._short(f.filename)}:{f.lineno} {f.name}", via
    return "(torch only)", via


class SyncWarnings:
    """Count CUDA sync-debug warnings (and others) inside the block, by call site."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.sync: Counter[str] = Counter()
        self.via: dict[str, str] = {}
        self.other: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.debug_mode_set = False

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        stack = traceback.extract_stack()[:-1]
        with self.lock:
            if "synchroniz" in text.lower():
                site, via = _site(stack)
                self.sync[site] += 1
                self.via.setdefault(site, via)
            else:
                self.other[f"{category.__name__}: {' '.join(text.split())[:160]}"] += 1

    def __enter__(self) -> SyncWarnings:
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
            self.debug_mode_set = True
        return self

    def __exit__(self, *exc) -> None:
        if self.debug_mode_set:
            torch.cuda.set_sync_debug_mode(0)
        self._cm.__exit__(*exc)

    def summary(self) -> dict:
        return {"sync_warnings": sum(self.sync.values()),
                "sync_sites": [{"site": s, "count": n, "via": self.via.get(s)}
                               for s, n in self.sync.most_common(12)],
                "other_warnings": sum(self.other.values()),
                "other_warning_kinds": [f"{n}x {m}" for m, n in self.other.most_common(4)]}


# ----------------------------------------------------------------------------- profile
def kernel_class(name: str, cat: str) -> str:
    if cat != "kernel":
        return "memcpy_memset"
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ATTN_KEYS):
        return "attention"
    if any(k in n for k in GEMM_KEYS):
        return "gemm"
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize_trace(path: Path, wall_ms: float) -> dict:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in
               ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_class: Counter[str] = Counter()
    by_name: dict[str, list] = {}
    spans = []
    for e in kernels:
        s, d = float(e["ts"]), float(e["dur"])
        cls = kernel_class(e.get("name", ""), e["cat"])
        by_class[cls] += d
        spans.append((s, s + d))
        row = by_name.setdefault(e.get("name", "?"), [0.0, 0, cls])
        row[0] += d
        row[1] += 1
    busy_ms = union_us(spans) / 1e3
    other_ms = sum(v for k, v in by_class.items() if k not in ("gemm", "attention")) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "wall_ms": wall_ms, "kernels": len(kernels),
        "gemm_ms": by_class["gemm"] / 1e3, "attention_ms": by_class["attention"] / 1e3,
        "other_ms": other_ms, "busy_ms": busy_ms, "idle_ms": wall_ms - busy_ms,
        "gemm_frac": by_class["gemm"] / 1e3 / wall_ms if wall_ms else None,
        "idle_frac": (wall_ms - busy_ms) / wall_ms if wall_ms else None,
        "overlap_ms": sum(by_class.values()) / 1e3 - busy_ms,
        "by_class_ms": {k: v / 1e3 for k, v in sorted(by_class.items())},
        "gpu_span_ms": (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3
        if spans else 0.0,
        "top_kernels": [{"name": n[:90], "ms": r[0] / 1e3, "calls": r[1], "class": r[2]}
                        for n, r in top],
    }


# ----------------------------------------------------------------------------- the worker
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_loader(job, env, dp_rank: int, dp: int):
    """The trainer's loader (`train.preflight.build_loader`)."""
    from train.preflight import build_loader as trainer_loader

    return trainer_loader(job, dp_rank, dp)


def worker(ctx: common.Ctx, out: dict) -> bool:
    args = ctx.args
    model_overrides = json.loads(args.model_overrides)
    run_dir = scratch_dir() / ("step-run-small" if ctx.small else "step-run")
    shutil.rmtree(run_dir, ignore_errors=True)
    (scratch_dir() / "step_trace.json").unlink(missing_ok=True)
    overrides = job_overrides(ctx.small, run_dir, model_overrides)
    out["overrides"] = overrides
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ[k] = v

    from launch.pretrain import load_job
    from parallel.dims import ParallelDims
    from parallel.parallel_model import balance_routers
    from parallel.parallelize import parallelize
    from train.config import micro_batches
    from train.distributed import init_distributed
    from train.observe.flops import flops_per_token, peak_flops
    from train.observe.metrics import memory_stats
    from train.observe.observers import SyncCounts
    from train.optim.build import build_optimizer, build_scheduler
    from train.trainer import train_step

    t = time.perf_counter()
    job = load_job(overrides, 1)
    out["compose_s"] = time.perf_counter() - t
    out["config"] = {"model_layers": job.model.num_hidden_layers,
                     "full_attn_layers": list(job.model.full_attn_layers),
                     "seq_len": job.data.seq_len, "global_batch": job.data.global_batch,
                     "micro_batch": job.data.micro_batch, "param_dtype": job.cluster.param_dtype,
                     "reduce_dtype": job.cluster.reduce_dtype, "backend": job.cluster.backend}
    env = init_distributed(job.cluster.device, job.cluster.backend, job.cluster.timeout_s)
    cuda = env.device.type == "cuda"
    try:
        t = time.perf_counter()
        dims = ParallelDims.from_config(job.parallel, env.world_size)
        meshes = dims.build_meshes(env.device.type)
        loader = build_loader(job, env, meshes.dp_rank, dims.dp)
        out["loader_s"] = time.perf_counter() - t
        t = time.perf_counter()
        logs: list[str] = []
        n_micro = micro_batches(job.data, dims.dp)
        pm = parallelize(job, dims, meshes, env.device, n_micro, log=logs.append)
        model = pm.model
        optimizer = build_optimizer(model, job.optim)
        scheduler = build_scheduler(optimizer, job.train.steps, job.optim)
        if cuda:
            torch.cuda.synchronize()
        out["build_s"] = time.perf_counter() - t
        out["params_total"] = sum(p.numel() for p in model.parameters())
        out["parallelize_log"] = logs[-3:]
        if cuda:
            out["mem_after_build_gib"] = torch.cuda.memory_allocated() / 2**30
        tokens_per_step = job.data.global_batch * job.data.seq_len
        steps: list[dict] = []
        out["steps"] = steps

        def one_step(kind: str, sync_warn: bool = False, count_syncs: bool = False,
                     profile_to: Path | None = None) -> dict:
            batches = loader.next_step()
            syncs = SyncCounts() if count_syncs else None
            rec: dict = {"step": len(steps) + 1, "kind": kind}
            sw = SyncWarnings(cuda) if sync_warn else contextlib.nullcontext()
            prof = contextlib.nullcontext()
            if profile_to is not None:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                prof = profile(activities=acts)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with prof as p, sw as w:
                with syncs.step if syncs else contextlib.nullcontext():
                    loss, ntok, gnorm, *_ = train_step(pm, optimizer, batches, env,
                                                      job.optim.grad_clip, syncs)
            if cuda:
                torch.cuda.synchronize()
            rec["train_step_s"] = time.perf_counter() - t0
            bw = SyncWarnings(cuda) if sync_warn else contextlib.nullcontext()
            scheduler.step()
            with bw as b:
                ratios = balance_routers(model, meshes.batch_group)
            for m in model.moe_layers():  # as train() does after logging
                m.gate.expert_load.zero_()
            if cuda:
                torch.cuda.synchronize()
            rec["step_s"] = time.perf_counter() - t0
            rec.update(loss=loss, target_tokens=ntok, grad_norm=gnorm,
                       tokens_per_sec=tokens_per_step / rec["step_s"],
                       expert_load_max_over_mean=(sum(ratios) / len(ratios)) if ratios else None)
            if sync_warn:
                rec.update(w.summary())
                rec["balance_routers_sync_warnings"] = b.summary()["sync_warnings"]
            if syncs is not None:
                rec.update(syncs.metrics())
            if cuda:
                rec["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if profile_to is not None:
                p.export_chrome_trace(str(profile_to))
                rec["profile"] = summarize_trace(profile_to, rec["train_step_s"] * 1e3)
            steps.append(rec)
            return rec

        plan = [("sync_debug", True, False, None), ("sync_debug", True, False, None),
                ("sync_debug+host_sync_counter", True, True, None),
                ("timed", False, False, None),
                ("profiled", False, False, scratch_dir() / "step_trace.json")]
        last = 0.0
        for kind, warn, count, prof_path in plan:
            need = max(15.0, 2.5 * last)
            if steps and ctx.left() < need:
                common.skip(out, f"step {len(steps) + 1} ({kind})")
                continue
            try:
                rec = one_step(kind, warn, count, prof_path)
            except Exception as e:  # noqa: BLE001 - recorded, the next step still runs
                steps.append({"step": len(steps) + 1, "kind": kind, **common.error_info(e)})
                out.setdefault("failed", []).append(f"step {len(steps)}")
                if isinstance(e, torch.OutOfMemoryError):
                    out["oom"] = True
                    break
                continue
            last = rec["step_s"]
        keep = os.environ.get("OUT")
        trace = scratch_dir() / "step_trace.json"
        if keep and trace.is_file():
            dest = Path(keep) / "traces" / "step_trace.json.gz"
            dest.parent.mkdir(parents=True, exist_ok=True)
            with trace.open("rb") as src, gzip.open(dest, "wb", compresslevel=4) as gz:
                shutil.copyfileobj(src, gz)
            if dest.stat().st_size > 25 * 2**20:
                dest.unlink()
        timed = [s for s in steps if s.get("kind") == "timed" and "step_s" in s]
        good = [s for s in steps if "step_s" in s]
        if timed or good:
            ref = timed[0] if timed else min(good[1:] or good, key=lambda s: s["step_s"])
            out["tokens_per_sec"] = ref["tokens_per_sec"]
            out["tokens_per_sec_from"] = f"step {ref['step']} ({ref['kind']})"
            peak = peak_flops(env.device)
            fpt = flops_per_token(job.model, job.data.seq_len)
            out["flops_per_token"] = fpt
            out["mfu"] = ref["tokens_per_sec"] * fpt / peak if peak else None
        prof = next((s["profile"] for s in steps if "profile" in s), None)
        if prof is not None and timed:  # idle without the profiler's own host overhead
            prof["idle_ms_vs_timed_step"] = timed[0]["train_step_s"] * 1e3 - prof["busy_ms"]
        out["losses"] = [s.get("loss") for s in steps]
        out["sync_warnings_per_step"] = [s.get("sync_warnings") for s in steps
                                         if "sync_warnings" in s]
        out.update(memory_stats(env.device))
        out["deepspeed_imported"] = "deepspeed" in sys.modules
        return bool(good)  # steps skipped for time are listed under "skipped", not failures
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the parent
def estimate(ctx: common.Ctx) -> dict:
    """Parameter count of k3_small (meta build) and the memory it needs for training."""
    from model.build import build_model
    from model.inspect import count_params

    counts = count_params(build_model("debug" if ctx.small else "k3_small", device="meta"))
    need = counts["total_params"] * BYTES_PER_PARAM / 2**30 + ACTIVATION_GIB
    have = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30 if ctx.cuda else None
    return {"total_params": counts["total_params"], "active_params": counts["active_params"],
            "need_gib_est": need, "gpu_gib": have,
            "fits_est": True if have is None else need <= 0.9 * have}


def parent(ctx: common.Ctx, out: dict) -> bool:
    est = common.attempt(out, "memory_estimate", lambda: estimate(ctx))
    plans = [[]] if est is None or est["fits_est"] else []
    plans.append(REDUCED)
    if ctx.small:
        plans = [[]]
    attempts = []
    result = None
    for model_overrides in plans:
        budget = ctx.left() - 5
        if budget < 30:
            common.skip(out, f"attempt {model_overrides or 'full'}", "stage budget")
            break
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device",
               ctx.args.device, "--budget", str(int(budget - 10)),
               "--model-overrides", json.dumps(model_overrides)] + (
                   ["--small"] if ctx.small else [])
        rc, so, se, timed_out = common.run_child(cmd, budget, env=os.environ.copy())
        line = common.last_json_line(so)
        att = {"model_overrides": model_overrides, "rc": rc, "timed_out": timed_out,
               "ok": bool(line and line.get("ok"))}
        if line is None:
            att["stderr_tail"] = common.tail(se)
        elif not line.get("ok"):
            att["error"] = line.get("error") or line.get("failed")
        attempts.append(att)
        result = line
        oom = "OutOfMemory" in (so + se) or bool(line and line.get("oom"))
        if line is not None and line.get("steps") and not oom:
            break  # ran (ok or not): do not retry smaller unless memory was the problem
        if not oom:
            break
    out["attempts"] = attempts
    if result is not None:
        for k, v in result.items():
            if k not in ("stage", "stage_s", "device", "small"):
                out[k] = v
    reduced = bool(attempts and attempts[-1]["model_overrides"])
    out["reduced"] = reduced
    if reduced:
        out["reduced_why"] = ("estimated memory above 90% of the GPU"
                              if est is not None and not est["fits_est"]
                              else "the full model ran out of memory")
    if ctx.args.state and attempts:
        Path(ctx.args.state).write_text(json.dumps(
            {"model_overrides": attempts[-1]["model_overrides"], "reduced": reduced}))
    return bool(result and result.get("ok"))


def main(ctx: common.Ctx, out: dict) -> bool:
    return worker(ctx, out) if ctx.args.worker else parent(ctx, out)


def extra(ap) -> None:
    ap.add_argument("--worker", action="store_true", help="(internal) run one attempt")
    ap.add_argument("--model-overrides", default="[]", help="(internal) JSON list")
    ap.add_argument("--state", default=None, help="write the model overrides that ran here")


if __name__ == "__main__":
    common.run_stage("step", main, extra)

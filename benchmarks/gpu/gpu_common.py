"""Shared helpers of the GPU suite's stages (`benchmarks/gpu_suite.sh`).

Every stage is a script that prints exactly one JSON line with "stage" and "ok", whatever
happens inside it: `run_stage(name, main)` parses the common arguments, calls `main(args, out)`
(which fills the dict `out`), and turns an exception into "ok": false with the error and the
last frames of its traceback. Sub-cases run through `attempt`, so one failing case is recorded
under its key and the others still run. "ok" means "ran without an error"; numerical verdicts
are separate fields ("within_tol" with the tolerances used).

Common arguments: `--device` (cuda when visible, else cpu), `--small` (tiny shapes: the CPU
smoke run), `--budget` (seconds this stage may take; cases that would start past it are
skipped and listed under "skipped").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

_CHILDREN: list[subprocess.Popen] = []  # process groups to end if this stage is told to stop


class Ctx:
    """Arguments plus the stage's clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.small = bool(args.small)
        self.t0 = time.monotonic()
        self.budget = float(args.budget)

    def left(self) -> float:
        """Seconds of this stage's budget still left."""
        return self.budget - (time.monotonic() - self.t0)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _clean(v: Any) -> Any:
    """JSON-safe values: floats rounded to 6 significant digits, NaN/inf as strings."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return float(f"{v:.6g}")
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return _clean(v.item())
    return str(v)


def error_info(e: BaseException) -> dict[str, Any]:
    """{"error": "Type: message" (one line, shortened), "where": last frames}."""
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    frames = traceback.extract_tb(e.__traceback__)[-4:]
    where = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in frames]
    return {"error": msg[:1500], "where": where}


def _short(path: str) -> str:
    """A path relative to the repo, or from site-packages / dist-packages on."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        pass
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def attempt(out: dict, key: str, fn: Callable[[], Any]) -> Any:
    """out[key] = fn(); an exception is stored as out[key] = {"error": ...} and key is added to
    out["failed"]. Returns fn()'s value or None."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - every failure is a result here
        out[key] = error_info(e)
        out.setdefault("failed", []).append(key)
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        return None
    out[key] = value
    return value


def skip(out: dict, key: str, why: str = "stage budget") -> None:
    out.setdefault("skipped", []).append(f"{key} ({why})")


def run_stage(name: str, main: Callable[[Ctx, dict], bool | None],
              extra_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Parse the common arguments, run `main(ctx, out)`, print one JSON line, exit 0."""
    ap = argparse.ArgumentParser(description=f"GPU suite stage {name}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds this stage may take")
    if extra_args is not None:
        extra_args(ap)
    args = ap.parse_args()
    out: dict[str, Any] = {"stage": name, "ok": False, "device": args.device,
                           "small": bool(args.small)}
    printed = [False]

    def emit() -> None:
        if not printed[0]:
            printed[0] = True
            out["stage_s"] = round(time.monotonic() - ctx.t0, 2)
            print(json.dumps(_clean(out)), flush=True)

    def on_term(signum, frame) -> None:  # the suite's timeout: still leave a line
        kill_children()
        out["ok"] = False
        out.setdefault("error", f"stopped by signal {signum} (suite timeout)")
        emit()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    ctx = Ctx(args)
    if ctx.cuda:
        # references are exact fp32: no TF32 in matmuls (cuDNN convs are not used here)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        ok = main(ctx, out)
        out["ok"] = (ok is None or bool(ok)) and not out.get("failed")
    except Exception as e:  # noqa: BLE001
        out["ok"] = False
        out.update(error_info(e))
    emit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (NCCL / Triton threads), the line is out


# ----------------------------------------------------------------------------- measuring
def finish(out: dict, timings: dict, errors_key: str) -> bool:
    """Close a numerics stage: its timings, failed sub-cases and the verdict of `errors_key`."""
    out["timings"] = timings
    if timings.get("failed"):
        out.setdefault("failed", []).extend(f"timings.{k}" for k in timings["failed"])
    errors = out.get(errors_key)
    out["within_tol"] = bool(isinstance(errors, dict) and errors.get("within_tol"))
    return True


def fwd_bwd_timing(ctx: Ctx, run: Callable[..., Any], repeats: int = 3) -> dict[str, Any]:
    """Times of `run(backward=False)` and `run()` (forward + backward) and the peak memory of
    one `run()`: fwd_ms, fwd_bwd_ms, bwd_ms (their difference), first_fwd_bwd_ms, peak_mib."""
    f = best_ms(ctx, lambda: run(backward=False), repeats=repeats)
    fb = best_ms(ctx, run, repeats=repeats)
    return {"fwd_ms": f["ms"], "fwd_bwd_ms": fb["ms"], "bwd_ms": fb["ms"] - f["ms"],
            "first_fwd_bwd_ms": fb["first_ms"], "peak_mib": peak_mib(ctx, run)}


def best_ms(ctx: Ctx, fn: Callable[[], Any], repeats: int = 3, warmup: int = 1,
            min_left: float = 5.0) -> dict[str, float]:
    """{"ms": best, "median_ms", "first_ms": the first (warm-up) call, "runs"}: wall time
    with device syncs around each call. Stops repeating when the budget runs low."""
    ctx.sync()
    times = []
    t = time.perf_counter()
    fn()
    ctx.sync()
    first = (time.perf_counter() - t) * 1e3
    for _ in range(max(0, warmup - 1)):
        fn()
    ctx.sync()
    for _ in range(repeats):
        if times and ctx.left() < min_left:
            break
        t = time.perf_counter()
        fn()
        ctx.sync()
        times.append((time.perf_counter() - t) * 1e3)
    if not times:
        times = [first]
    times.sort()
    return {"ms": times[0], "median_ms": times[len(times) // 2], "first_ms": first,
            "runs": len(times)}


def peak_mib(ctx: Ctx, fn: Callable[[], Any]) -> float | None:
    """Peak extra device memory of one call of fn, MiB (None on CPU)."""
    if not ctx.cuda:
        fn()
        return None
    ctx.sync()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    fn()
    ctx.sync()
    return (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20


def rel_err(got: torch.Tensor | None, ref: torch.Tensor | None) -> dict[str, Any]:
    """{"max_rel": max|got - ref| / max|ref|, "norm_rel": ||got - ref|| / ||ref||}, in fp32."""
    if got is None or ref is None:
        return {"missing": "got" if got is None else "ref"}
    g, r = got.detach().float(), ref.detach().float()
    if g.shape != r.shape:
        return {"shape_mismatch": [list(g.shape), list(r.shape)]}
    d = g - r
    scale = r.abs().max().clamp_min(1e-30)
    out = {"max_rel": float(d.abs().max() / scale) if d.numel() else 0.0,
           "norm_rel": float(d.norm() / r.norm().clamp_min(1e-30)) if d.numel() else 0.0}
    if not bool(torch.isfinite(g).all()):
        out["nonfinite"] = int((~torch.isfinite(g)).sum())
    return out


def worst(errs: dict[str, dict], key: str = "norm_rel") -> float:
    """Largest `key` over a dict of rel_err results (inf if any is missing)."""
    vals = [e.get(key, float("inf")) for e in errs.values()]
    return max(vals) if vals else float("inf")


def device_name(ctx: Ctx) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"


# ----------------------------------------------------------------------------- children
def kill_children() -> None:
    for p in _CHILDREN:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run_child(cmd: list[str], timeout: float, env: dict | None = None,
              cwd: Path = ROOT) -> tuple[int | None, str, str, bool]:
    """Run `cmd` in its own process group; (rc, stdout, stderr, timed_out). On timeout the
    whole group (torchrun and its workers) is killed."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    _CHILDREN.append(p)
    try:
        so, se = p.communicate(timeout=max(1.0, timeout))
        return p.returncode, so, se, False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            so, se = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            so, se = p.communicate()
        return None, so, se, True
    finally:
        _CHILDREN.remove(p)


def tail(text: str, lines: int = 15, chars: int = 3000) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None

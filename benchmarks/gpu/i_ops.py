"""Stage i (ops): the roofline's most expensive kernels replayed one by one on the device,
predicted against measured time per call (issue #13).

    python benchmarks/gpu/i_ops.py [--device cuda] [--small] [--top 30]

`benchmarks/roofline.py` `analyze(replay=True)` traces one step of stage f's job (k3_small,
seq_len 4096, one micro-batch of 1 on one GPU; the roofline's 4 uneven documents; H200
constants, or H100 / B200 when that is the device) and keeps, per op, its overload and
argument specs. Records are grouped by (overload, argument specs): a group is one distinct
kernel call, made `count` times a step.
Groups are taken by predicted time per step, largest first, until `--top` were attempted or the
budget runs low; each is replayed on random tensors of the recorded sizes, strides and dtypes
(`op_replay.py`), under no_grad.

Timing: 2 warm-up calls (cuBLAS / Triton set-up), then up to 15 batches of back-to-back calls
between CUDA events (perf_counter on CPU), a batch ~1 ms long: measured_us = the median batch /
its calls. That is one call as an eager step runs it, host dispatch included when it is the
slower side, the quantity the roofline's max(compute, memory) + 5 us per kernel predicts.
Per group: op, category, count, shapes, predicted_us, measured_us, ratio (measured/predicted);
one op's error or out-of-memory is kept in its row and the next one runs (after a CUDA error
that poisons the context, e.g. a device-side assert, nothing more is measured). Totals over the
measured groups: predicted and measured ms per step (x count), and the share of the roofline's
predicted step they cover. Groups that cannot be replayed (analytic fsdp.* records, arguments
without a spec, integer arguments of unknown meaning, CUDA-only ops on CPU, too large for the
free memory, Triton-kernel ops with under 15 s left: a first call compiles) are counted, the
first 12 listed under not_replayed with the reason. ok: the analysis ran and most
attempted groups were measured. `--small` (CPU smoke run): model=debug, seq_len 128.
`python benchmarks/gpu/collect.py table RESULTS` turns the line into the README's table.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter, defaultdict

import gpu_common as common
import torch

sys.path.insert(0, str(common.ROOT / "benchmarks"))
import op_replay  # noqa: E402
import roofline  # noqa: E402

FULL = ["model=k3_small", "data.seq_len=4096", "data.micro_batch=1", "data.global_batch=1",
        "data.docs_per_row=4"]
SMALL = ["model=debug", "data.seq_len=128", "data.micro_batch=1", "data.global_batch=1",
         "data.docs_per_row=3"]
MAX_BATCHES, MIN_BATCHES, BATCH_S = 15, 3, 1e-3
END_MARGIN_S = 3.0  # left for the JSON line
LIST_NOT_REPLAYED = 12
# k3 ops other than these run Triton kernels (fla KDA, our fused elementwise ones): their first
# call compiles and autotunes, which nothing here can interrupt, so they run only with
# JIT_MIN_LEFT_S of the budget left
LIBRARY_K3_OPS = {"k3.grouped_mm", "k3.grouped_mm_wgrad", "k3.wgrad_accumulate",
                  "k3.varlen_attention", "k3.varlen_attention_backward"}
JIT_MIN_LEFT_S = 15.0


class Group:
    """Records of one distinct kernel call: same overload, same argument specs."""

    def __init__(self, records: list[roofline.OpRecord], gpu: roofline.GPU) -> None:
        first = records[0]
        self.name = first.name
        self.replay = first.replay
        self.count = sum(r.count for r in records)  # calls per step (micro-batches included)
        self.per_call_s = sum(r.time(gpu) for r in records) / self.count
        self.total_s = self.per_call_s * self.count
        cats = Counter(r.category for r in records)
        self.category = "/".join(c for c, _ in cats.most_common())

    @property
    def why_not(self) -> str | None:
        if self.replay is None:
            return "analytic record (no traced op)"
        return self.replay.why_not

    def row(self) -> dict:
        out = {"op": str(self.replay.op) if self.replay is not None else self.name,
               "category": self.category, "count": self.count,
               "predicted_us": self.per_call_s * 1e6}
        if self.replay is not None and self.replay.why_not is None:
            out["shapes"] = op_replay.describe(self.replay)
        return out


def group_records(records: list[roofline.OpRecord], gpu: roofline.GPU) -> list[Group]:
    """Distinct kernel calls, the largest predicted time per step first."""
    by: dict[tuple, list[roofline.OpRecord]] = defaultdict(list)
    for r in records:
        rp = r.replay
        if rp is None or rp.why_not is not None:
            key: tuple = ("not replayable", r.name, None if rp is None else rp.why_not)
        else:
            key = (rp.op, rp.args, rp.kwargs)
        by[key].append(r)
    groups = [Group(rs, gpu) for rs in by.values()]
    return sorted(groups, key=lambda g: -g.total_s)


def gpu_constants(ctx: common.Ctx) -> str:
    """The roofline's GPU entry for this device (H200 unless it is an H100 or a B200)."""
    name = common.device_name(ctx).upper()
    for key in ("h100", "b200"):
        if key.upper() in name:
            return key
    return "h200"


def time_calls(ctx: common.Ctx, fn, max_s: float) -> dict:
    """Median per-call time of batches of back-to-back calls (see the module docstring)."""
    t0 = time.perf_counter()
    fn()
    ctx.sync()
    first_ms = (time.perf_counter() - t0) * 1e3
    fn()
    ctx.sync()
    t = time.perf_counter()
    fn()
    ctx.sync()
    est = max(time.perf_counter() - t, 1e-6)
    per_batch = max(1, min(100, round(BATCH_S / est)))
    times: list[float] = []
    while len(times) < MAX_BATCHES:
        if len(times) >= MIN_BATCHES and time.perf_counter() - t0 > max_s:
            break
        if ctx.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(per_batch):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / per_batch)
        else:
            t = time.perf_counter()
            for _ in range(per_batch):
                fn()
            times.append((time.perf_counter() - t) / per_batch)
    return {"measured_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6,
            "first_call_ms": first_ms, "calls_timed": per_batch * len(times)}


def _context_lost(err: str) -> bool:
    return any(s in err for s in ("device-side assert", "illegal memory access",
                                  "CUDA error", "unspecified launch failure"))


def measure(ctx: common.Ctx, group: Group, bounds: list[int], max_s: float) -> dict:
    """Build the group's arguments on the device and time its op (raises NotReplayable)."""
    rp = group.replay
    need = op_replay.input_bytes(rp)
    if ctx.cuda:
        free = torch.cuda.mem_get_info(ctx.device)[0]
        if 2.2 * need > free:  # inputs, outputs of about their size, and some room
            raise op_replay.NotReplayable(f"needs ~{2.2 * need / 2**30:.1f} GiB, "
                                          f"{free / 2**30:.1f} GiB free")
    res = _replay(ctx, rp, bounds, max_s)
    if need > 2**30:  # the arguments went with _replay's frame
        _free(ctx)
    return {**res, "input_mib": need / 2**20}


def _replay(ctx: common.Ctx, rp: roofline.Replay, bounds: list[int], max_s: float) -> dict:
    with torch.no_grad():
        args, kwargs = op_replay.build(rp, ctx.device, bounds)
        return time_calls(ctx, lambda: rp.op(*args, **kwargs), max_s)


def _free(ctx: common.Ctx) -> None:
    if ctx.cuda:
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a lost context: the next op's row says so
            pass


def measure_groups(ctx: common.Ctx, groups: list[Group], bounds: list[int], step_s: float,
                   out: dict) -> None:
    """Rows of the top groups in `out["ops"]`, the first groups that cannot be replayed in
    `out["not_replayed"]` (all of them counted), `out["totals"]` after each row."""
    rows, not_replayed = out["ops"], out["not_replayed"]
    out.update(not_replayed_n=0, not_replayed_predicted_ms=0.0)
    totals(out, step_s)
    top = ctx.args.top
    for i, g in enumerate(groups):
        if len(rows) >= top:
            break
        left = ctx.left() - END_MARGIN_S
        if left < 1.0:
            common.skip(out, f"{len(groups) - i} more groups", "stage budget")
            break
        row = g.row()
        why = g.why_not or op_replay.device_why_not(g.replay.op, ctx.device)
        jit = g.name.startswith("k3.") and g.name not in LIBRARY_K3_OPS
        if why is None and jit and left < JIT_MIN_LEFT_S:
            why = f"Triton compile on first call: needs {JIT_MIN_LEFT_S:.0f} s, {left:.0f} left"
        if why is None:
            try:
                row.update(measure(ctx, g, bounds, min(2.0, left / (top - len(rows)))))
                row["ratio"] = row["measured_us"] / row["predicted_us"]
            except op_replay.NotReplayable as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 - one op's failure is its row's result
                row["error"] = common.error_info(e)["error"][:300]
        if why is not None:
            out["not_replayed_n"] += 1
            out["not_replayed_predicted_ms"] += g.total_s * 1e3
            if len(not_replayed) < LIST_NOT_REPLAYED:
                not_replayed.append({**row, "why": why})
            continue
        rows.append(row)
        totals(out, step_s)
        if "error" in row:  # out of the except: no frame holds the arguments now
            if ctx.cuda and _context_lost(row["error"]):
                out["cuda_context_lost_at"] = row["op"]
                break
            _free(ctx)


def main(ctx: common.Ctx, out: dict) -> bool:
    overrides = SMALL if ctx.small else FULL
    gpu = gpu_constants(ctx)
    out.update(overrides=overrides, gpu_constants=gpu, top=ctx.args.top)
    t = time.perf_counter()
    summary, records = roofline.analyze(overrides, gpu, world=1, replay=True)
    out.update(analysis_s=time.perf_counter() - t, preset=summary["preset"],
               tokens=summary["tokens"], kernels=summary["kernels"],
               predicted_step_s=summary["predicted_step_s"],
               predicted_fwd_bwd_s=summary["fwd_bwd_s"], doc_lengths=summary["doc_lengths"])
    bounds = [0]
    for n in summary["doc_lengths"]:
        bounds.append(bounds[-1] + n)
    groups = group_records(records, roofline.GPUS[gpu])
    del records
    out.update(distinct_calls=len(groups), ops=[], not_replayed=[])
    measure_groups(ctx, groups, bounds, summary["predicted_step_s"], out)
    return out["measured"] > 0 and out["measured"] >= 0.5 * out["attempted"]


def totals(out: dict, step_s: float) -> None:
    """Per-step sums over the measured groups (kept current: a stage stopped by the suite's
    timeout still prints them)."""
    done = [r for r in out["ops"] if "measured_us" in r]
    pred = sum(r["predicted_us"] * r["count"] for r in done) / 1e3
    meas = sum(r["measured_us"] * r["count"] for r in done) / 1e3
    out["totals"] = {"groups": len(done), "predicted_ms": pred, "measured_ms": meas,
                     "ratio": meas / pred if pred > 0 else None,
                     "share_of_predicted_step": pred / 1e3 / step_s if step_s > 0 else None}
    out.update(attempted=len(out["ops"]), measured=len(done))


def extra(ap) -> None:
    ap.add_argument("--top", type=int, default=30, help="groups to attempt (default 30)")


if __name__ == "__main__":
    common.run_stage("ops", main, extra)

"""The suite's bookkeeping: one result line per stage, and the closing summary line.

    python benchmarks/gpu/collect.py stage NAME RC WALL_S STDOUT_FILE STDERR_FILE
    python benchmarks/gpu/collect.py skip NAME WHY
    python benchmarks/gpu/collect.py summary RESULTS_FILE WALL_S
    python benchmarks/gpu/collect.py passed RESULTS_FILE NAME KEY   (exit 0 if ok and KEY)
    python benchmarks/gpu/collect.py table RESULTS_FILE

`stage`: the stage's own JSON line (the last line of its stdout that parses), with "rc" and
"wall_s" added; when there is none (a crash, a hard timeout: rc 124/137), a line with "ok":
false, the error and the tail of the stage's stderr. `summary`: {"stage": "summary", "ok": every
stage ok, "stages": name -> ok, "wall_s"} plus stage f's and g's first losses side by side
(the same job built two ways: in-process through train_step, and by the launcher). `table`:
the README's markdown of stage ops (predicted vs measured time per kernel call, their sums per
step) and the step-level line: stage step's measured step time against the roofline's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "stage" in obj:
                return obj
    return None


def read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def stage(name: str, rc: str, wall: str, stdout: str, stderr: str) -> dict:
    so, se = read(stdout), read(stderr)
    line = last_json(so)
    code = int(rc) if rc.lstrip("-").isdigit() else None
    if line is None:
        why = {124: "hard timeout (suite)", 137: "killed (timeout or out of host memory)"}
        line = {"stage": name, "ok": False,
                "error": why.get(code, f"no JSON line from the stage (exit code {rc})"),
                "stderr_tail": "\n".join(se.strip().splitlines()[-20:])[-3000:],
                "stdout_tail": "\n".join(so.strip().splitlines()[-5:])[-1000:]}
    line["stage"] = name  # the suite's name (g_launcher.py runs as launcher and launcher_compiled)
    line["rc"], line["wall_s"] = code, float(wall)
    if code in (124, 137):
        line["timed_out"] = True
    return line


def passed(results: str, name: str, key: str) -> bool:
    """Whether stage `name`'s line in `results` has ok and a true `key`."""
    rows = [json.loads(x) for x in read(results).splitlines() if x.strip().startswith("{")]
    rows = [r for r in rows if r.get("stage") == name]
    return bool(rows) and bool(rows[-1].get("ok")) and bool(rows[-1].get(key))


def summary(results: str, wall: str) -> dict:
    rows = [json.loads(x) for x in read(results).splitlines() if x.strip().startswith("{")]
    stages = {r.get("stage", "?"): bool(r.get("ok")) for r in rows}
    out: dict = {"stage": "summary", "ok": bool(stages) and all(stages.values()),
                 "stages": stages, "wall_s": float(wall),
                 "fused_fallback": os.environ.get("K3_GPU_SUITE_FUSED_FALLBACK") == "1"}
    by = {r.get("stage"): r for r in rows}
    f, g = by.get("step", {}), by.get("launcher", {})
    if f.get("losses") and g.get("losses"):
        n = min(len(f["losses"]), len(g["losses"]))
        out["step_vs_launcher_losses"] = [f["losses"][:n], g["losses"][:n]]
    for key in ("tokens_per_sec", "mfu", "max_mem_gib", "reduced", "sync_warnings_per_step"):
        if key in f:
            out[f"step_{key}"] = f[key]
    return out


def _us(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def table(results: str) -> str:
    """Markdown: one row per measured kernel call of stage ops, their per-step sums, the
    step-level line (stage step's timed step vs the roofline's predicted step)."""
    rows = [json.loads(x) for x in read(results).splitlines() if x.strip().startswith("{")]
    by = {r.get("stage"): r for r in rows}
    ops, f = by.get("ops"), by.get("step", {})
    if not ops or "ops" not in ops:
        return f"no result of stage ops in {results}"
    head = (f"Stage ops ({ops.get('device')}, {ops.get('preset')}, {ops.get('tokens')} tokens, "
            f"{ops.get('gpu_constants', '?').upper()} constants): per call, back-to-back.")
    lines = [head, "", "| op | category | calls/step | shapes | predicted µs | measured µs "
             "| measured / predicted |", "|---|---|---|---|---|---|---|"]
    for r in ops["ops"]:
        got = _us(r.get("measured_us")) if "error" not in r else "error"
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        lines.append(f"| `{r['op']}` | {r['category']} | {r['count']} | {r.get('shapes', '')} "
                     f"| {_us(r['predicted_us'])} | {got} | {ratio} |")
    t = ops.get("totals", {})
    if t.get("groups"):
        share = t.get("share_of_predicted_step") or 0.0
        lines.append(f"| **sum of the {t['groups']} measured, ms per step** | | | {share:.0%} "
                     f"of the predicted step | {t['predicted_ms']:.2f} | {t['measured_ms']:.2f} "
                     f"| {t['ratio']:.2f} |")
    lines += ["", _step_line(ops, f)]
    if ops.get("not_replayed_n"):
        why = "; ".join(f"`{r['op']}` ({r['why']})" for r in ops.get("not_replayed", [])[:6])
        lines.append(f"Not replayed among the largest: {ops['not_replayed_n']} distinct calls, "
                     f"{ops.get('not_replayed_predicted_ms', 0):.2f} ms per step predicted: "
                     f"{why}.")
    return "\n".join(lines)


def _step_line(ops: dict, f: dict) -> str:
    pred = ops.get("predicted_step_s")
    src = f.get("tokens_per_sec_from", "")
    num = int(src.split()[1]) if src.startswith("step ") and src.split()[1].isdigit() else None
    step = next((s for s in f.get("steps", []) if s.get("step") == num and "step_s" in s), None)
    if pred is None or step is None:
        return f"Step: predicted {pred if pred is None else f'{pred:.3f}'} s; no measured step."
    cfg = f.get("config", {})
    tokens = (cfg.get("seq_len") or 0) * (cfg.get("global_batch") or 0)
    extra = ", reduced model" if f.get("reduced") else ""
    return (f"Step: roofline {pred:.3f} s ({ops.get('tokens')} tokens) vs stage step "
            f"{step['step_s']:.3f} s ({src}, {tokens} tokens{extra}; train_step "
            f"{step.get('train_step_s', float('nan')):.3f} s): measured / predicted "
            f"{step['step_s'] / pred:.2f}.")


def main(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "table":
        print(table(argv[1]), flush=True)
        return 0
    if kind == "passed":
        return 0 if passed(*argv[1:4]) else 1
    if kind == "stage":
        line = stage(*argv[1:6])
    elif kind == "skip":
        line = {"stage": argv[1], "ok": False, "skipped": argv[2]}
    else:
        line = summary(argv[1], argv[2])
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

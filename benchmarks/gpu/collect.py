"""The suite's bookkeeping: one result line per stage, and the closing summary line.

    python benchmarks/gpu/collect.py stage NAME RC WALL_S STDOUT_FILE STDERR_FILE
    python benchmarks/gpu/collect.py skip NAME WHY
    python benchmarks/gpu/collect.py summary RESULTS_FILE WALL_S

`stage`: the stage's own JSON line (the last line of its stdout that parses), with "rc" and
"wall_s" added; when there is none (a crash, a hard timeout: rc 124/137), a line with "ok":
false, the error and the tail of the stage's stderr. `summary`: {"stage": "summary", "ok": every
stage ok, "stages": name -> ok, "wall_s"} plus stage f's and g's first losses side by side
(the same job built two ways: in-process through train_step, and by the launcher).
"""

from __future__ import annotations

import json
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
    line["rc"], line["wall_s"] = code, float(wall)
    if code in (124, 137):
        line["timed_out"] = True
    return line


def summary(results: str, wall: str) -> dict:
    rows = [json.loads(x) for x in read(results).splitlines() if x.strip().startswith("{")]
    stages = {r.get("stage", "?"): bool(r.get("ok")) for r in rows}
    out: dict = {"stage": "summary", "ok": bool(stages) and all(stages.values()),
                 "stages": stages, "wall_s": float(wall)}
    by = {r.get("stage"): r for r in rows}
    f, g = by.get("step", {}), by.get("launcher", {})
    if f.get("losses") and g.get("losses"):
        n = min(len(f["losses"]), len(g["losses"]))
        out["step_vs_launcher_losses"] = [f["losses"][:n], g["losses"][:n]]
    for key in ("tokens_per_sec", "mfu", "max_mem_gib", "reduced", "sync_warnings_per_step"):
        if key in f:
            out[f"step_{key}"] = f[key]
    return out


def main(argv: list[str]) -> int:
    kind = argv[0]
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

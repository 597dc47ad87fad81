"""Forward+backward time of the `debug` preset on CPU (one thread, fp32); prints one JSON line.

    python benchmarks/debug_step_cpu.py [--batch 4] [--seq 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model.build import build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model("debug", seed=0)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)

    def step() -> None:
        s, n = model(ids, labels=labels)
        (s / n).backward()

    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(json.dumps({"bench": "debug_step_cpu", "batch": args.batch, "seq": args.seq,
                      "threads": args.threads, "fwd_bwd_ms": round(best * 1e3, 1),
                      "tokens_per_sec": round(args.batch * args.seq / best)}))


if __name__ == "__main__":
    main()

"""One optimizer step of `optim=muon` (Per-Head Muon + AdamW) against `optim=adamw` on this CPU;
one JSON line.

    python benchmarks/optimizer_step_cpu.py [--model cpu_bench] [--threads 1] [--repeats 3]

What: `train.optim.build.build_optimizer` for both configs over the preset's parameters (fp32) with
random gradients, best of `--repeats` steps after one warm-up step (state allocation), in CPU
seconds of this process (`time.process_time`); `adamw_unfused_loop_step_cpu_s` is torch's
per-parameter AdamW loop (`foreach=False`, what `optim=adamw` ran on a CPU before it took the
fused implementation there). Also reported: parameters and matrices on the
Muon side, its Newton-Schulz blocks and their shapes (blocks of one shape run as one batched
iteration), and the Newton-Schulz FLOPs per step (5 iterations of X X^T, (bA + cA^2) and B X on
each [r, c] block, r <= c: 5 (4 r^2 c + 2 r^3)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.timing import best_seconds  # noqa: E402
from model.build import build_model  # noqa: E402
from train.config import OptimConfig  # noqa: E402
from train.optim.build import build_optimizer  # noqa: E402
from train.optim.muon import muon_blocks, ns_flops  # noqa: E402


def best_cpu_s(fn, repeats: int) -> float:
    """CPU seconds of the fastest of `repeats` calls after a warm-up."""
    return best_seconds(fn, repeats, clock=time.process_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cpu_bench")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model, seed=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    out: dict = {"bench": "optimizer_step_cpu", "model": args.model, "threads": args.threads,
                 "params": sum(p.numel() for p in model.parameters())}
    for name in ("adamw", "muon"):
        opt = build_optimizer(model, OptimConfig(name=name))
        out[f"{name}_step_cpu_s"] = best_cpu_s(opt.step, args.repeats)
    # what `optim=adamw` ran on a CPU before it took torch's fused AdamW there
    loop = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    out["adamw_unfused_loop_step_cpu_s"] = best_cpu_s(loop.step, args.repeats)
    blocks = muon_blocks(model)
    params = dict(model.named_parameters())
    shapes: Counter = Counter()
    for n, b in blocks.items():
        for part in b.views(params[n].detach()):
            shapes[tuple(part.shape[1:])] += part.shape[0]
    flops = sum(k * ns_flops(r, c) for (r, c), k in shapes.items())
    out.update(muon_params=sum(params[n].numel() for n in blocks), muon_matrices=len(blocks),
               ns_blocks=sum(shapes.values()), ns_block_shapes=len(shapes),
               ns_flops_per_step=flops,
               muon_over_adamw=out["muon_step_cpu_s"] / out["adamw_step_cpu_s"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

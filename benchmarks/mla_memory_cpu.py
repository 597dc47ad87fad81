"""Peak memory of one Gated MLA layer over packed documents: blockwise attention vs a T x T mask.

Run from the repo root: ``python benchmarks/mla_memory_cpu.py`` (debug-size layer, T=8192,
4 documents, fp32, forward + backward). Each variant runs in a fresh process and reports its
peak RSS growth (``ru_maxrss`` after the step minus before it, after a T=512 warm-up):
``blockwise`` is the layer as it is (`model.ops.attention`, the CPU path); ``dense_mask`` swaps
in what the layer did before, SDPA with a [B, 1, T, T] same-document causal mask. Prints one
JSON line (MB, seconds). ``--T``, ``--docs``, ``--threads`` change the setting.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dense_mask_attention(q, k, v, packing, scale):
    """The former packed path: one [B, 1, T, T] bool mask for SDPA (O(T^2) memory)."""
    import torch
    import torch.nn.functional as F

    d = packing.doc_ids
    T = d.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=d.device).tril()
    mask = ((d[:, :, None] == d[:, None, :]) & causal).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def measure(variant: str, T: int, docs: int, threads: int) -> dict:
    import torch

    import model.mla
    from model.packing import Packing
    from tests.helpers.tiny import debug_config

    torch.set_num_threads(threads)
    if variant == "dense_mask":
        model.mla.packed_causal_attention = dense_mask_attention
    cfg = debug_config()
    torch.manual_seed(0)
    mla = model.mla.GatedMLA(cfg)

    def step(seq: int) -> None:
        x = torch.randn(1, seq, cfg.hidden_size, requires_grad=True)
        cu = torch.linspace(0, seq, docs + 1).round().to(torch.int32)
        mla(x, Packing(1, seq, "cpu", cu)).square().sum().backward()

    step(512)  # warm-up: kernels, thread pools
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    step(T)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_growth_mb": round((after - before) / 1024, 1), "seconds": round(seconds, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", choices=["blockwise", "dense_mask"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:  # child process: one variant
        print(json.dumps(measure(a.variant, a.T, a.docs, a.threads)))
        return
    out = {"benchmark": "mla_memory_cpu", "T": a.T, "docs": a.docs, "threads": a.threads}
    for variant in ("blockwise", "dense_mask"):
        r = subprocess.run([sys.executable, __file__, "--variant", variant, "--T", str(a.T),
                            "--docs", str(a.docs), "--threads", str(a.threads)],
                           cwd=ROOT, capture_output=True, text=True, check=True)
        out[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

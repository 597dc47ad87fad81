"""CPU timing of the KDA PyTorch references: chunked (UT transform) vs the token recurrence.

Run from the repo root: ``python benchmarks/kda_cpu.py``. Prints one JSON line (times in ms).
Forward-only timings run under torch.no_grad(); "*_fwd_bwd" is forward + backward (autograd)
w.r.t. q, k, v, g, beta. fp32, B=1, T=2048, best of a few runs after a warm-up.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.ops.kda import chunk_kda_reference, recurrent_kda  # noqa: E402


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` runs after one warm-up run, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def bench(B: int, T: int, H: int, D: int, chunk_size: int = 64, repeats: int = 3
          ) -> dict[str, float | int]:
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    inputs = (q, k, v, g, beta)

    with torch.no_grad():
        chunk_ms = best_ms(lambda: chunk_kda_reference(*inputs, chunk_size=chunk_size), repeats)
        rec_ms = best_ms(lambda: recurrent_kda(*inputs), repeats)
        o_c, _ = chunk_kda_reference(*inputs, chunk_size=chunk_size)
        o_r, _ = recurrent_kda(*inputs)

    def fwd_bwd(fn: Callable[..., tuple[torch.Tensor, object]]) -> None:
        leaves = [x.detach().requires_grad_() for x in inputs]
        o, _ = fn(*leaves)
        o.square().sum().backward()

    chunk_fb_ms = best_ms(lambda: fwd_bwd(functools.partial(chunk_kda_reference,
                                                            chunk_size=chunk_size)), repeats)
    rec_fb_ms = best_ms(lambda: fwd_bwd(recurrent_kda), 1)

    return {
        "B": B, "T": T, "H": H, "K": D, "V": D, "chunk_size": chunk_size,
        "chunk_fwd_ms": round(chunk_ms, 2),
        "recurrent_fwd_ms": round(rec_ms, 2),
        "speedup_fwd": round(rec_ms / chunk_ms, 2),
        "chunk_fwd_bwd_ms": round(chunk_fb_ms, 2),
        "recurrent_fwd_bwd_ms": round(rec_fb_ms, 2),
        "speedup_fwd_bwd": round(rec_fb_ms / chunk_fb_ms, 2),
        "max_abs_diff": float((o_c - o_r).abs().max()),
    }


def main() -> None:
    # K3's lower-bounded gate: chunk 16 takes the factored matmul path, chunk 64 the broadcast one
    results = [bench(1, 2048, 4, 64, c) for c in (16, 64)] + [bench(1, 2048, 2, 128, 16)]
    print(json.dumps({"bench": "kda_cpu", "dtype": "float32", "threads": torch.get_num_threads(),
                      "gate": "lower_bound_-5", "results": results}))


if __name__ == "__main__":
    main()

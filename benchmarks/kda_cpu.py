"""CPU timing of the KDA PyTorch references: chunked (UT transform) vs the token recurrence.

Run from the repo root: ``python benchmarks/kda_cpu.py`` (the default set: B=1, T=2048, chunk 16
and 64, K3's lower-bounded gate). Prints one JSON line (times in ms). Forward-only timings run
under torch.no_grad(); "*_fwd_bwd" is forward + backward (autograd) w.r.t. q, k, v, g, beta.
fp32, best of a few runs after a warm-up.

Options for small or targeted runs, e.g.
``python benchmarks/kda_cpu.py --T 1024 --H 2 --chunk-sizes 64 --docs 8 --no-recurrent``:
``--docs N`` packs N documents of uneven (seeded, exponentially distributed) lengths into one
row and times the varlen path (``cu_seqlens``); ``--gate softplus`` uses Kimi Linear's unbounded
gate; ``--impl FILE`` times another copy of ``model/ops/kda.py`` (before/after comparisons).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_impl(path: str | None) -> ModuleType:
    """`model.ops.kda`, or the module in file `path` (another version of it)."""
    if path is None:
        import model.ops.kda as mod
        return mod
    spec = importlib.util.spec_from_file_location("kda_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` runs after one warm-up run, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def doc_lengths(T: int, n: int, seed: int = 0) -> list[int]:
    """n uneven document lengths (exponential, like real data; each >= 1) summing to T."""
    gen = torch.Generator().manual_seed(seed)
    w = -torch.rand(n, generator=gen, dtype=torch.float64).log()  # Exp(1)
    raw = (w / w.sum() * (T - n)).floor().long() + 1
    raw[0] += T - int(raw.sum())
    return [int(x) for x in raw]


def bench(kda: ModuleType, B: int, T: int, H: int, D: int, chunk_size: int = 64,
          repeats: int = 3, gate: str = "bounded", docs: int = 0, recurrent: bool = True
          ) -> dict[str, float | int | str]:
    gen = torch.Generator().manual_seed(0)
    B = 1 if docs else B
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    f = torch.randn(B, T, H, D, generator=gen)
    g = -5.0 * torch.sigmoid(f) if gate == "bounded" else -F.softplus(3.0 * f - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    inputs = (q, k, v, g, beta)
    kw: dict[str, object] = {"chunk_size": chunk_size}
    out: dict[str, float | int | str] = {"B": B, "T": T, "H": H, "K": D, "V": D,
                                         "chunk_size": chunk_size, "gate": gate}
    if docs:
        lengths = doc_lengths(T, docs)
        kw["cu_seqlens"] = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        rows_padded = len(lengths) * math.ceil(max(lengths) / chunk_size) * chunk_size
        rows_aligned = sum(math.ceil(n / chunk_size) * chunk_size for n in lengths)
        out.update(docs=docs, longest=max(lengths), rows_pad_to_longest=rows_padded,
                   rows_doc_aligned=rows_aligned)
    chunk = functools.partial(kda.chunk_kda_reference, **kw)

    def fwd_bwd(fn: Callable[..., tuple[torch.Tensor, object]]) -> None:
        leaves = [x.detach().requires_grad_() for x in inputs]
        o, _ = fn(*leaves)
        o.square().sum().backward()

    with torch.no_grad():
        out["chunk_fwd_ms"] = round(best_ms(lambda: chunk(*inputs), repeats), 2)
    out["chunk_fwd_bwd_ms"] = round(best_ms(lambda: fwd_bwd(chunk), repeats), 2)
    if recurrent:
        rec = functools.partial(kda.recurrent_kda, cu_seqlens=kw.get("cu_seqlens"))
        with torch.no_grad():
            rec_ms = best_ms(lambda: rec(*inputs), repeats)
            o_c, _ = chunk(*inputs)
            o_r, _ = rec(*inputs)
        rec_fb_ms = best_ms(lambda: fwd_bwd(rec), 1)
        out.update(recurrent_fwd_ms=round(rec_ms, 2),
                   speedup_fwd=round(rec_ms / float(out["chunk_fwd_ms"]), 2),
                   recurrent_fwd_bwd_ms=round(rec_fb_ms, 2),
                   speedup_fwd_bwd=round(rec_fb_ms / float(out["chunk_fwd_bwd_ms"]), 2),
                   max_abs_diff=float((o_c - o_r).abs().max()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=None, help="heads (default: the built-in set)")
    p.add_argument("--D", type=int, default=64, help="head dim K = V")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--chunk-sizes", default="16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gate", choices=["bounded", "softplus"], default="bounded")
    p.add_argument("--docs", type=int, default=0, help="pack this many uneven documents")
    p.add_argument("--no-recurrent", action="store_true", help="skip the token recurrence")
    p.add_argument("--impl", default=None, help="path of a kda.py to time instead")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kda = load_impl(args.impl)
    sizes = [int(c) for c in args.chunk_sizes.split(",")]
    common = {"repeats": args.repeats, "gate": args.gate, "docs": args.docs,
              "recurrent": not args.no_recurrent}
    if args.H is None:  # the built-in set: H=4, D=64 per chunk size, plus H=2, D=128, chunk 16
        configs = [(4, 64, c) for c in sizes] + [(2, 128, 16)]
    else:
        configs = [(args.H, args.D, c) for c in sizes]
    results = [bench(kda, args.B, args.T, h, d, c, **common) for h, d, c in configs]
    print(json.dumps({"bench": "kda_cpu", "dtype": "float32", "threads": torch.get_num_threads(),
                      "impl": args.impl or "model/ops/kda.py", "results": results}))


if __name__ == "__main__":
    main()

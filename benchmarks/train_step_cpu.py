"""CPU training efficiency, measurable on any machine: tokens/s and MFU against this machine's
own fp32 GEMM rate; prints one JSON line.

    python benchmarks/train_step_cpu.py [--threads N] [--steps 3] [--modes eager[,compiled]]
        [--mtp] [--components] [--gemm-ceiling]

What: the `cpu_bench` preset (configs/model/cpu_bench.yaml: hidden 512, KDA + gated MLA,
AttnRes, latent MoE with shared experts; every component) trains in fp32 on packed documents
(`--batch` rows of `--seq` tokens, `--docs` uneven documents per row): forward, backward and an
AdamW step (`train.optim.build.build_optimizer`, `optim=adamw`: torch's fused AdamW), best of
`--steps` timed steps after one warm-up. The GEMM rate is measured in the same process at the
same thread count: the best of `torch.mm` over the model's own GEMM shapes
(tokens x hidden x 1408, tokens x hidden x hidden, tokens x 256 x 256 and tokens x hidden x
vocab), fp32. MFU = model FLOPs of the batch (`train.observe.flops.step_flops`, what the trainer
reports) / step time / that GEMM rate (`mfu_vs_measured_gemm`: the best step against the
best GEMM rate of the run, the up-front probe's or any later one's; `gemm_fp32_flops` is the
up-front probe alone). The GEMM rate of a shared machine moves by tens of percent from minute
to minute, so each timed step is also paired with a short probe right after it
(`gemm_flops_after_each`, the same shapes, best of 2): `mfu_paired_median` is the median over
steps of that step's FLOP/s over its own probe, the figure to compare from day to day.
`compiled` wraps every decoder layer in `torch.compile` (inductor, as `parallel.compile=true`
does; the first step compiles: ~90 s cold on 2 cores, the KDA reference's chunk math being one
opaque custom op; opt-in).
Threads default to all cores (`os.cpu_count()`). Host memory is set up as the trainer sets it
on CPU (`train.host_memory.keep_freed_memory`: freed activations stay in the process, no page
faults every step); `minor_page_faults_per_step` reports what is left.
`--components` adds where an eager step's time goes: forward+backward of one KDA attention
(and of its chunked KDA op alone: forward, and forward+backward), one gated MLA, one latent MoE
and the dense SiTU-GLU MLP on the step's hidden states (random, packed documents), each with
its FLOPs (`torch.utils.flop_counter`, the op's own count) and achieved FLOP/s.
`--gemm-ceiling` times two more eager steps, profiles a third (torch.profiler, CPU) and splits
its operator self time into dense products (BLAS: mm, bmm, addmm, baddbmm, the triangular
solve, the grouped GEMM's per-group mm included; and the CPU flash-attention kernels) and
everything else. `mfu_ceiling_without_non_gemm` = model FLOPs / (the unprofiled step time x the
products' share of op time) / the run's best GEMM rate: what the step would reach if every
other op were free, the bound on what fusing or removing non-GEMM work alone can give (the
profiler slows small ops more than large ones, so the share, and the ceiling, err low).
`blas_rate_in_step` (the BLAS calls' FLOPs, from their recorded shapes, over their profiled
time) says how fast the BLAS runs the model's actual shapes against the probe's large ones,
`blas_flops_vs_model_flops` how much more it computes than the model count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.timing import best_seconds  # noqa: E402
from model.build import build_model  # noqa: E402
from model.config import load_model_config  # noqa: E402
from model.packing import Packing  # noqa: E402
from parallel.activation_checkpoint import apply_compile  # noqa: E402
from train.config import OptimConfig  # noqa: E402
from train.host_memory import keep_freed_memory  # noqa: E402
from train.observe.flops import step_flops  # noqa: E402
from train.optim.build import build_optimizer  # noqa: E402


def gemm_rate(tokens: int, shapes: list[tuple[int, int]], repeats: int = 5) -> float:
    """Best fp32 FLOP/s of torch.mm [tokens, k] x [k, n] over the given (k, n)."""
    best = 0.0
    g = torch.Generator().manual_seed(0)
    for k, n in shapes:
        a, b = torch.randn(tokens, k, generator=g), torch.randn(k, n, generator=g)
        torch.mm(a, b)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2.0 * tokens * k * n / (time.perf_counter() - t0))
    return best


def gemm_shapes(cfg) -> list[tuple[int, int]]:
    """(k, n) of the model's own GEMMs: hidden x 1408, hidden x hidden, 256 x 256, hidden x
    vocab."""
    return [(cfg.hidden_size, cfg.intermediate_size), (cfg.hidden_size, cfg.hidden_size),
            (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size),
            (cfg.hidden_size, cfg.vocab_size)]


def doc_lengths(seq: int, docs: int) -> list[int]:
    """`docs` uneven documents filling a row of `seq` tokens (lengths ~ 1, 2, 3, ... parts)."""
    parts = list(range(1, docs + 1))
    lengths = [seq * p // sum(parts) for p in parts]
    lengths[-1] += seq - sum(lengths)
    return lengths


def packed_rows(args: argparse.Namespace) -> tuple[list[int], Packing]:
    """Document lengths and packing of `--batch` rows of `--seq` tokens, `--docs` per row."""
    lengths = doc_lengths(args.seq, args.docs) * args.batch
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return lengths, Packing.from_host(cu, args.batch, args.seq, torch.device("cpu"))


def train_step(cfg, args: argparse.Namespace, compiled: bool = False
               ) -> tuple[Callable[[], None], list[int]]:
    """(one training step of a fresh `cfg` model on the benchmark's packed batch: forward,
    backward, AdamW as `optim=adamw` trains; the batch's document lengths)."""
    model = build_model(cfg, seed=0)
    model.train()
    if compiled:
        apply_compile(model.decoder_layers())
    opt = build_optimizer(model, OptimConfig(name="adamw"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    lengths, packing = packed_rows(args)

    def step() -> None:
        s, n = model(ids, packing, labels=labels)
        (s / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lengths


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    cfg = load_model_config("cpu_bench", num_nextn_predict_layers=int(args.mtp))
    step, lengths = train_step(cfg, args, compiled=mode == "compiled")
    B, T = args.batch, args.seq
    t0 = time.perf_counter()
    step()  # warm-up (compiles in `compiled`)
    first = time.perf_counter() - t0
    times, faults, rates = [], [], []
    for _ in range(args.steps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        rates.append(gemm_rate(B * T, gemm_shapes(cfg), repeats=2))  # right after this step
    best = min(times)
    flops = step_flops(cfg, lengths)
    paired = sorted(flops / t / r for t, r in zip(times, rates))
    return {"step_s": best, "first_step_s": first, "tokens_per_sec": B * T / best,
            "minor_page_faults_per_step": min(faults),
            "model_flops": flops, "achieved_flops": flops / best,
            "mfu_paired_median": paired[len(paired) // 2],
            "step_s_each": [round(t, 3) for t in times],
            "gemm_flops_after_each": [round(r / 1e9, 1) for r in rates]}


# dense products: BLAS (FLOPs from their shapes, `_blas_flops`) and the fused attention kernel
BLAS_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
                      "aten::baddbmm_", "aten::linalg_solve_triangular"})
ATTENTION_OPS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu",
                           "aten::_scaled_dot_product_flash_attention_for_cpu_backward"})


def _blas_flops(name: str, shapes: list[list[int]]) -> float:
    """FLOPs of one BLAS call from its input shapes (the profiler's record_shapes)."""
    if name == "aten::linalg_solve_triangular":  # A [.., n, n], B [.., n, r]: n^2 r per batch
        *batch, n, r = shapes[1]
        return float(math.prod(batch) * n * n * r)
    a, b = (shapes[0], shapes[1]) if name in ("aten::mm", "aten::bmm") else (shapes[1], shapes[2])
    return 2.0 * math.prod(a) * b[-1]


def profiled_blas_flops(events) -> float:
    """FLOPs of the BLAS calls among profiler events (recorded with shapes)."""
    return sum(_blas_flops(e.name, e.input_shapes) for e in events if e.name in BLAS_OPS)


def gemm_ceiling(args: argparse.Namespace, best_rate: float) -> dict:
    """One profiled eager step split into dense-product and other operator self time (see the
    module docstring): times from a plain profile (recording shapes slows the small ops
    several-fold), the products' FLOPs from a second, shape-recording one."""
    from torch.profiler import ProfilerActivity, profile

    cfg = load_model_config("cpu_bench", num_nextn_predict_layers=int(args.mtp))
    step, lengths = train_step(cfg, args)
    step()
    step_s = best_seconds(step, 2)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    profiled_s = time.perf_counter() - t0
    blas_us = attn_us = other_us = 0.0
    for e in prof.key_averages():
        if e.key in BLAS_OPS:
            blas_us += e.self_cpu_time_total
        elif e.key in ATTENTION_OPS:
            attn_us += e.self_cpu_time_total
        else:
            other_us += e.self_cpu_time_total
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    blas_flops = profiled_blas_flops(prof.events())
    blas_s, attn_s, other_s = blas_us * 1e-6, attn_us * 1e-6, other_us * 1e-6
    share = (blas_s + attn_s) / (blas_s + attn_s + other_s)
    flops = step_flops(cfg, lengths)
    return {"step_s": round(step_s, 3), "profiled_step_s": round(profiled_s, 3),
            "blas_s": round(blas_s, 3), "attention_kernel_s": round(attn_s, 3),
            "other_s": round(other_s, 3), "products_share_of_op_time": round(share, 3),
            "blas_rate_in_step": round(blas_flops / blas_s / 1e9, 1),
            "blas_flops_vs_model_flops": round(blas_flops / flops, 3),
            "mfu": round(flops / step_s / best_rate, 4),
            "mfu_ceiling_without_non_gemm": round(flops / (step_s * share) / best_rate, 4)}


def components(args: argparse.Namespace) -> dict:
    """Forward+backward seconds, FLOPs and FLOP/s of each kind of sub-layer (see docstring)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_model_config("cpu_bench")
    model = build_model(cfg, seed=0)
    model.train()
    layers = model.decoder_layers()
    kda_layer = next(la for la in layers if type(la.self_attn).__name__ == "KimiDeltaAttention"
                     and hasattr(la, "block_sparse_moe"))
    mla_layer = next(la for la in layers if type(la.self_attn).__name__ == "GatedMLA")
    dense = next(la for la in layers if hasattr(la, "mlp"))
    B, T = args.batch, args.seq
    lengths, packing = packed_rows(args)
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)

    att = kda_layer.self_attn
    seen = {}
    op = att.kda_op

    def capture(*a):  # the op's own inputs, as the layer computes them
        seen["args"] = a
        return op(*a)

    att.kda_op = capture
    att(x, packing)
    att.kda_op = op
    q, k, v, f, b, pk, gate, chunk = seen["args"]
    op_in = [t.detach().clone().requires_grad_() for t in (q, k, v, f, b)]

    def kda_op_fwd() -> None:
        with torch.no_grad():
            op(*op_in, pk, gate, chunk)

    def fwd_bwd(fn):
        def go() -> None:
            fn().float().sum().backward()
        return go

    cases = {
        "kda_attention": fwd_bwd(lambda: att(x, packing)),
        "kda_op": fwd_bwd(lambda: op(*op_in, pk, gate, chunk)),
        "kda_op_forward": kda_op_fwd,
        "mla_attention": fwd_bwd(lambda: mla_layer.self_attn(x, packing)),
        "latent_moe": fwd_bwd(lambda: kda_layer.block_sparse_moe(x)),
        "dense_mlp": fwd_bwd(lambda: dense.mlp(x)),
    }
    out = {}
    for name, fn in cases.items():
        with FlopCounterMode(display=False) as fc:
            fn()
        s, flops = best_seconds(fn, 3), fc.get_total_flops()
        out[name] = {"ms": round(s * 1e3, 1), "gflop": round(flops / 1e9, 2),
                     "gflop_per_s": round(flops / s / 1e9, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=4, help="documents per row")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="eager", help="eager and/or compiled, comma-separated")
    ap.add_argument("--mtp", action="store_true", help="with the MTP module (its FLOPs counted)")
    ap.add_argument("--components", action="store_true",
                    help="also time each kind of sub-layer, forward+backward")
    ap.add_argument("--gemm-ceiling", action="store_true",
                    help="also profile one eager step: GEMM vs other time, the MFU ceiling")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    cfg = load_model_config("cpu_bench")
    tokens = args.batch * args.seq
    rate = gemm_rate(tokens, gemm_shapes(cfg))
    out = {"bench": "train_step_cpu", "preset": "cpu_bench", "mtp": args.mtp,
           "threads": args.threads,
           "batch": args.batch, "seq": args.seq, "docs_per_row": args.docs,
           "gemm_fp32_flops": rate}
    best_rate = rate
    for mode in args.modes.split(","):
        try:
            r = run_mode(mode, args)
        except Exception as e:  # noqa: BLE001 - a failed mode is a result here
            out[mode] = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:500]}
            continue
        mode_rate = max(rate, *(g * 1e9 for g in r.get("gemm_flops_after_each", [])))
        best_rate = max(best_rate, mode_rate)
        r["mfu_vs_measured_gemm"] = r["achieved_flops"] / mode_rate
        out[mode] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
    if args.components:
        out["components"] = components(args)
    if args.gemm_ceiling:
        out["gemm_ceiling"] = gemm_ceiling(args, best_rate)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The fused glue ops on this CPU against autograd over their reference formulas; one JSON line.

    python benchmarks/fused_ops_cpu.py [--threads 1] [--repeats 5]

What: forward + backward of each op the model calls (`model.ops`: `attnres_mix`, `situ_glu`,
`short_conv_silu`, `rms_norm`) and of its `*_reference` on the `cpu_bench` widths (2 x 1024
tokens, hidden 512, 3 snapshots + the prefix, SiTU over 1408 columns, 4-tap conv with 4 documents
per row), fp32, best of `--repeats` after a warm-up, in CPU seconds of this process
(`time.process_time`, steadier than wall time on a shared machine). Off CUDA the AttnRes mix
has a PyTorch implementation of its own and the short conv runs oneDNN's depthwise convolution
(`model.ops.short_conv._conv_fwd_cpu`); SiTU-GLU and the norms are their references there
(ratio ~1), and their Triton kernels are CUDA's (benchmarks/gpu/j_fused.py times those).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.timing import best_seconds  # noqa: E402
from model.ops.attnres import attnres_mix, attnres_mix_reference  # noqa: E402
from model.ops.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from model.ops.short_conv import short_conv_silu, short_conv_silu_reference  # noqa: E402
from model.ops.situ import situ_glu, situ_glu_reference  # noqa: E402


def fwd_bwd(f, leaves: list[torch.Tensor], grad: torch.Tensor):
    def run() -> None:
        torch.autograd.grad(f(*leaves), leaves, grad)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, T, d, n = 2, 1024, 512, 3

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).requires_grad_()

    blocks, prefix = rand(n, B, T, d), rand(B, T, d)
    nw, q = rand(d), rand(d, scale=0.05)
    gate, up = rand(B * T, 1408, scale=3.0), rand(B * T, 1408, scale=3.0)
    x, w = rand(B, T, d), rand(d, 4, scale=0.3)
    pos = torch.arange(T).remainder(T // 4)[None].expand(B, -1)
    nweight = rand(d)
    cases = {
        "attnres_mix": (fwd_bwd(lambda b, x_, w_, q_: attnres_mix(b, x_, w_, q_), [
            blocks, prefix, nw, q], torch.randn(B, T, d, generator=g)),
            fwd_bwd(lambda b, x_, w_, q_: attnres_mix_reference(
                torch.cat([b, x_[None]]), w_ * q_), [blocks, prefix, nw, q],
                torch.randn(B, T, d, generator=g))),
        "situ_glu": (fwd_bwd(situ_glu, [gate, up], torch.randn(B * T, 1408, generator=g)),
                     fwd_bwd(situ_glu_reference, [gate, up],
                             torch.randn(B * T, 1408, generator=g))),
        "short_conv_silu": (fwd_bwd(lambda a, b: short_conv_silu(a, b, pos), [x, w],
                                    torch.randn(B, T, d, generator=g)),
                            fwd_bwd(lambda a, b: short_conv_silu_reference(a, b, pos), [x, w],
                                    torch.randn(B, T, d, generator=g))),
        "rms_norm": (fwd_bwd(lambda a, b: rms_norm(a, b, 1e-5), [x, nweight],
                             torch.randn(B, T, d, generator=g)),
                     fwd_bwd(lambda a, b: rms_norm_reference(a, b, 1e-5), [x, nweight],
                             torch.randn(B, T, d, generator=g))),
    }
    out: dict = {"bench": "fused_ops_cpu", "threads": args.threads, "tokens": B * T,
                 "hidden": d, "unit": "cpu_s fwd+bwd"}
    for name, (op, ref) in cases.items():
        t_op, t_ref = (best_seconds(f, args.repeats, time.process_time) for f in (op, ref))
        out[name] = {"op_s": round(t_op, 5), "reference_s": round(t_ref, 5),
                     "speedup": round(t_ref / t_op, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

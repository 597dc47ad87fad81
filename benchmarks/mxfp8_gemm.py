"""MXFP8 GEMMs at K3 expert shapes: numerics against fp32 and timing against bf16.

    python benchmarks/mxfp8_gemm.py                    # CUDA if present, K3 shapes
    python benchmarks/mxfp8_gemm.py --device cpu --small

Numerics: forward and the three gradients of `mx_linear` and of the grouped `mx_grouped_mm`
(G experts, uneven token groups) relative to a float64 reference, next to bf16's error for
scale. Timing: forward+backward of one expert GEMM stack (w1/w3 [m, l], w2 [l, m]) in bf16
(`grouped_mm`) vs MXFP8 (`mx_grouped_mm`, whatever `mx_backend` picks: emulated on CPU and
Hopper, native `F.scaled_grouped_mm` on SM100). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.ops.grouped_gemm import grouped_mm  # noqa: E402
from model.ops.mx_linear import mx_backend, mx_grouped_mm, mx_linear  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def linear_errors(T: int, K: int, N: int, dev: torch.device) -> dict[str, float]:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, K, device=dev, generator=g)
    w = torch.randn(N, K, device=dev, generator=g) / K ** 0.5
    dy = torch.randn(T, N, device=dev, generator=g)
    out = {}
    ref_x, ref_w = x.double().requires_grad_(), w.double().requires_grad_()
    ref_y = ref_x @ ref_w.t()
    ref_y.backward(dy.double())
    for name, fn, dtype in (("mx", mx_linear, torch.float32),
                            ("bf16", lambda a, b: a @ b.t(), torch.bfloat16)):
        xx = x.detach().to(dtype).clone().requires_grad_()
        ww = w.detach().to(dtype).clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(dy.to(y.dtype))
        out[f"{name}_fprop"] = rel(y, ref_y)
        out[f"{name}_dgrad"] = rel(xx.grad, ref_x.grad)
        out[f"{name}_wgrad"] = rel(ww.grad, ref_w.grad)
    return out


def grouped_inputs(G: int, T: int, K: int, N: int, dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(1)
    weights = torch.rand(G, device=dev, generator=g) + 0.2
    sizes = (weights / weights.sum() * T).floor().long()
    sizes[-1] += T - int(sizes.sum())
    x = torch.randn(T, K, device=dev, generator=g)
    w = torch.randn(G, N, K, device=dev, generator=g) / K ** 0.5
    return x, w, sizes


def grouped_errors(G: int, T: int, K: int, N: int, dev: torch.device) -> dict[str, float]:
    x, w, sizes = grouped_inputs(G, T, K, N, dev)
    ref = torch.cat([xs.double() @ w[i].double().t()
                     for i, xs in enumerate(x.split(sizes.tolist()))])
    y = mx_grouped_mm(x, w, sizes)
    return {"mx_grouped_fprop": rel(y, ref)}


def time_expert_stack(gemm, dtype, G: int, T: int, latent: int, inter: int,
                      dev: torch.device, iters: int) -> float:
    x, w1, sizes = grouped_inputs(G, T, latent, inter, dev)
    w2 = torch.randn(G, latent, inter, device=dev) / inter ** 0.5
    x, w1, w2 = (t.to(dtype).requires_grad_() for t in (x, w1, w2))

    def step() -> None:
        h = gemm(x, w1, sizes)
        y = gemm(torch.nn.functional.silu(h), w2, sizes)
        y.backward(torch.ones_like(y))

    step()  # warm-up (and cuBLAS/autotune)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    dev = torch.device(args.device)
    if args.small:
        latent, inter, experts, tokens = 256, 192, 4, 512
    else:  # K3: latent 3584, expert intermediate 3072; 14 local experts (896 / ep 64)
        latent, inter, experts, tokens = 3584, 3072, 14, 14 * 2048
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "backend": mx_backend(dev), "grouped_backend": mx_backend(dev, grouped=True),
           "latent": latent, "intermediate": inter,
           "experts": experts, "tokens": tokens}
    out.update(linear_errors(min(tokens, 4096), latent, inter, dev))
    out.update(grouped_errors(experts, min(tokens, 8192), latent, inter, dev))
    bf16 = time_expert_stack(grouped_mm, torch.bfloat16, experts, tokens, latent, inter, dev,
                             args.iters)
    mx_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # as under FSDP bf16
    mx = time_expert_stack(mx_grouped_mm, mx_dtype, experts, tokens, latent, inter, dev,
                           args.iters)
    flops = 6 * tokens * latent * inter * 2  # fwd + 2 bwd GEMMs, two expert GEMMs
    out.update(bf16_ms=round(bf16 * 1e3, 2), mx_ms=round(mx * 1e3, 2),
               mx_over_bf16=round(mx / bf16, 2), bf16_tflops=round(flops / bf16 / 1e12, 3),
               mx_tflops=round(flops / mx / 1e12, 3))
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}))


if __name__ == "__main__":
    main()

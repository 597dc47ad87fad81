"""Stage c (grouped_gemm): bf16 `grouped_mm` (k3::grouped_mm over torch._grouped_mm) against
`_padded_bmm` in fp32, forward and backward.

    python benchmarks/gpu/c_grouped_gemm.py [--device cuda] [--small]

K3-ish shape: 64 groups, 3584 -> 3072 (w [64, 3072, 3584]), 16384 rows in uneven groups with
empty ones (groups 0 and 32) and odd sizes (1, 3, 17, ...). `--small`: 6 groups, 64 -> 48, 301
rows. Reports relative errors of y, dx, dw against the fp32 reference on the same bf16 values,
the largest |dw| of the empty groups (must be exactly 0), and ms of forward and forward+backward
for grouped_mm bf16, _padded_bmm bf16 and the fp32 reference, plus grouped_mm's TFLOP/s; and
`fused_wgrad`: the weight gradient added into an fp32 buffer by `k3::grouped_wgrad_accumulate`
(our Triton kernel on CUDA, gradient-accumulation fusion), its error against the fp32 reference
and its ms and TFLOP/s against the unfused form (bf16 grouped wgrad, then an add).
"""

from __future__ import annotations

import functools

import gpu_common as common
import torch

from model.ops.grouped_gemm import _grouped_mm_wgrad_op, _padded_bmm, grouped_mm, grouped_mm_backend
from model.ops.wgrad import grouped_wgrad_accumulate

TOL_NORM_REL = 1e-2  # bf16 operands, fp32 accumulation


def group_sizes(G: int, S: int, seed: int = 0) -> torch.Tensor:
    """Uneven sizes summing to S: groups 0 and G//2 empty, group 1 of 1 row, group 2 of 3, the
    rest random and odd where possible (the last takes the remainder)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(G, generator=gen, dtype=torch.float64) + 0.2
    w[[0, G // 2]] = 0.0
    sizes = (w / w.sum() * S).floor().long()
    sizes = sizes - (sizes % 2 == 0).long() * (sizes > 0).long()  # odd where non-empty
    sizes[1], sizes[2] = 1, 3
    sizes[0] = sizes[G // 2] = 0
    sizes[-1] += S - int(sizes.sum())
    assert int(sizes.sum()) == S and int(sizes.min()) >= 0
    return sizes


def main(ctx: common.Ctx, out: dict) -> bool:
    dev = ctx.device
    G, K, N, S = (6, 64, 48, 301) if ctx.small else (64, 3584, 3072, 16384)
    sizes = group_sizes(G, S)
    empty = (sizes == 0).nonzero().flatten().tolist()
    out.update(groups=G, in_features=K, out_features=N, rows=S, empty_groups=empty,
               odd_groups=int((sizes % 2 == 1).sum()), largest_group=int(sizes.max()),
               tol_norm_rel=TOL_NORM_REL)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(S, K, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(G, N, K, generator=gen, device=dev) / K**0.5).to(torch.bfloat16)
    dy = torch.randn(S, N, generator=gen, device=dev).to(torch.bfloat16)
    sz = sizes.to(dev)
    out["backend_bf16"] = grouped_mm_backend(x, w)
    if ctx.cuda and out["backend_bf16"] != "grouped_mm":
        out.setdefault("failed", []).append("backend_bf16")

    def run(fn, dtype: torch.dtype, backward: bool = True):
        xx = x.detach().to(dtype, copy=True).requires_grad_()
        ww = w.detach().to(dtype, copy=True).requires_grad_()
        y = fn(xx, ww, sz)
        if backward:
            y.backward(dy.to(dtype))
        return y.detach(), xx.grad, ww.grad

    def errors() -> dict:
        y, dx, dw = run(grouped_mm, torch.bfloat16)
        y_ref, dx_ref, dw_ref = run(_padded_bmm, torch.float32)
        errs = {"y": common.rel_err(y, y_ref), "dx": common.rel_err(dx, dx_ref),
                "dw": common.rel_err(dw, dw_ref)}
        res = {**errs, "worst_norm_rel": common.worst(errs),
               "dw_empty_groups_max_abs": float(dw[empty].abs().max()) if empty else 0.0}
        res["within_tol"] = (res["worst_norm_rel"] <= TOL_NORM_REL
                             and res["dw_empty_groups_max_abs"] == 0.0)
        return res

    common.attempt(out, "errors", errors)
    flops = 2.0 * S * K * N
    offs = torch.cumsum(sz, 0).to(torch.int32)

    def fused_wgrad() -> dict:
        """The experts' weight gradient added into an fp32 buffer (gradient-accumulation
        fusion, `k3::grouped_wgrad_accumulate`: our Triton kernel on CUDA) against the fp32
        reference, and its time against the unfused form (bf16 grouped wgrad, then the add)."""
        buf = torch.zeros(G, N, K, device=dev)
        grouped_wgrad_accumulate(buf, dy, x, offs)
        res = {"dw": common.rel_err(buf, run(_padded_bmm, torch.float32)[2])}
        res["within_tol"] = res["dw"]["norm_rel"] <= TOL_NORM_REL
        if not res["within_tol"]:
            out.setdefault("failed", []).append("fused_wgrad")
        fused = common.best_ms(ctx, lambda: grouped_wgrad_accumulate(buf, dy, x, offs))
        unfused = common.best_ms(ctx, lambda: buf.add_(_grouped_mm_wgrad_op(dy, x, offs)))
        res.update(fused_ms=fused["ms"], unfused_ms=unfused["ms"],
                   fused_tflops=flops / fused["ms"] / 1e9,
                   unfused_tflops=flops / unfused["ms"] / 1e9)
        return res

    if ctx.left() > 10:
        common.attempt(out, "fused_wgrad", fused_wgrad)
    timings: dict = {}
    for name, fn, dtype in (("grouped_mm_bf16", grouped_mm, torch.bfloat16),
                            ("padded_bmm_bf16", _padded_bmm, torch.bfloat16),
                            ("padded_bmm_fp32", _padded_bmm, torch.float32)):
        if ctx.left() < 8:
            common.skip(out, name)
            continue

        def timing(fn=fn, dtype=dtype) -> dict:
            t = common.fwd_bwd_timing(ctx, functools.partial(run, fn, dtype), repeats=5)
            return {**t, "fwd_tflops": flops / t["fwd_ms"] / 1e9,
                    "fwd_bwd_tflops": 3 * flops / t["fwd_bwd_ms"] / 1e9}

        common.attempt(timings, name, timing)
    return common.finish(out, timings, "errors")


if __name__ == "__main__":
    common.run_stage("grouped_gemm", main)

"""Stage j (fused): our Triton AttnRes mix, SiTU-GLU, short-conv, row-norm, MoE-combine and
MXFP8-cast kernels against their references.

    python benchmarks/gpu/j_fused.py [--device cuda] [--small]

AttnRes: k3_small's widest mix (8 snapshots + the prefix, hidden 2048, 4096 tokens) and K3's
(hidden 7168, 4096 tokens), bf16 sources, fp32 norm weight and pseudo-query (std 0.02 query, as
trained); SiTU-GLU: the expert activations of a k3_small micro-batch (4096 tokens x top-8 x
1024), bf16; the short conv and RMSNorm on k3_small's KDA projections (4096 tokens x 4096
channels, 4 documents), KDA's sigmoid-gated output norm and the L2 norm over [4096, 32, 128]
heads; the MoE combine of 4096 tokens x top-8 x latent 1024 (bf16 expert outputs, fp32
weights); the MXFP8 cast (`k3::mx_cast`) of 4096 x 8 x 1024 bf16 activations along both axes,
both scale modes, bit for bit against `model.ops.mx`'s PyTorch quantiser. The reference is the
autograd-differentiated formula (`*_reference`) in fp32 on the same bf16 values. Reports
errors of the output and every gradient (rel_err), and ms of forward and forward + backward for
the kernel (the model's op: `k3::attnres_mix`, `k3::situ_glu`, `k3::short_conv`,
`k3::row_norm`, `k3::moe_combine`, backend triton) and for the reference, which is what the
step ran before.
`within_tol` false makes gpu_suite.sh run the later stages on the PyTorch paths
(K3_*_BACKEND=torch), so one bad kernel does not cost the step measurements.
`--small` (CPU smoke run): tiny shapes, the PyTorch backends of the same ops.
"""

from __future__ import annotations

import functools
import os

import gpu_common as common
import torch

from model.ops.attnres import attnres_mix, attnres_mix_reference
from model.ops.combine import weighted_combine, weighted_combine_reference
from model.ops.mx import _mx_quantize_reference, mx_quantize
from model.ops.rms_norm import (
    gated_rms_norm,
    gated_rms_norm_reference,
    l2_norm,
    l2_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from model.ops.short_conv import short_conv_silu, short_conv_silu_reference
from model.ops.situ import situ_glu, situ_glu_reference

BACKEND_VARS = ("K3_ATTNRES_BACKEND", "K3_SITU_BACKEND", "K3_CONV_BACKEND", "K3_NORM_BACKEND",
                "K3_COMBINE_BACKEND", "K3_MX_CAST_BACKEND")

TOL = {"norm_rel": 1e-2}  # bf16 outputs and gradients against fp32 maths


def _leaves(xs, dtype=None):
    return [x.detach().to(dtype or x.dtype, copy=True).requires_grad_() for x in xs]


def _errors(got: list[torch.Tensor], ref: list[torch.Tensor], names: list[str]) -> dict:
    errs = {n: common.rel_err(g, r) for n, g, r in zip(names, got, ref)}
    return {**errs, "worst_norm_rel": common.worst(errs),
            "within_tol": common.worst(errs) <= TOL["norm_rel"]}


def _attnres_case(ctx: common.Ctx, n: int, d: int, tokens: int) -> tuple[dict, dict]:
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(n + 1, tokens, d, generator=gen, device=dev).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(d, generator=gen, device=dev)
    q = 0.02 * torch.randn(d, generator=gen, device=dev)
    g = torch.randn(tokens, d, generator=gen, device=dev).to(torch.bfloat16)

    def kernel(backward: bool = True):
        b, x, ww, qq = _leaves([src[:-1], src[-1], w, q])
        out = attnres_mix(b, x, ww, qq, 1e-5)
        if backward:
            return [out, *torch.autograd.grad(out, (b, x, ww, qq), g)]
        return [out]

    def reference(backward: bool = True):
        s, ww, qq = _leaves([src.float(), w, q])
        out = attnres_mix_reference(s, ww * qq, 1e-5)
        if backward:
            ds, dw, dq = torch.autograd.grad(out, (s, ww, qq), g.float())
            return [out, ds[:-1], ds[-1], dw, dq]
        return [out]

    errs = _errors(kernel(), reference(), ["out", "d_blocks", "d_prefix", "d_norm_w", "d_query"])
    times = {name: common.fwd_bwd_timing(ctx, fn) for name, fn in
             (("kernel", kernel), ("reference", reference)) if ctx.left() > 8}
    return errs, times


def _situ_case(ctx: common.Ctx, rows: int, cols: int) -> tuple[dict, dict]:
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(1)
    gate = (3 * torch.randn(rows, cols, generator=gen, device=dev)).to(torch.bfloat16)
    up = (30 * torch.randn(rows, cols, generator=gen, device=dev)).to(torch.bfloat16)
    g = torch.randn(rows, cols, generator=gen, device=dev).to(torch.bfloat16)

    def run(fn, dtype, backward: bool = True):
        a, b = _leaves([gate, up], dtype)
        out = fn(a, b)
        return [out, *torch.autograd.grad(out, (a, b), g.to(dtype))] if backward else [out]

    kernel = functools.partial(run, situ_glu, None)
    reference = functools.partial(run, situ_glu_reference, torch.float32)
    errs = _errors(kernel(), reference(), ["out", "d_gate", "d_up"])
    times = {name: common.fwd_bwd_timing(ctx, fn) for name, fn in
             (("kernel", kernel), ("reference", reference)) if ctx.left() > 8}
    return errs, times


def _elementwise_case(ctx: common.Ctx, name: str, shape: tuple[int, ...]) -> tuple[dict, dict]:
    """The short conv ([1, T, C], 4 documents) or a row norm over `shape`, bf16."""
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(2)
    if name != "combine":
        x = torch.randn(*shape, generator=gen, device=dev).to(torch.bfloat16)
        g = torch.randn(*shape, generator=gen, device=dev).to(torch.bfloat16)
    if name == "short_conv":
        w = 0.3 * torch.randn(shape[-1], 4, generator=gen, device=dev)
        pos = torch.arange(shape[1], device=dev).remainder(shape[1] // 4)[None]
        pair = (lambda a, b: short_conv_silu(a, b, pos),
                lambda a, b: short_conv_silu_reference(a, b, pos))
        leaves = [x, w]
    elif name == "rms_norm":
        w = 1 + 0.1 * torch.randn(shape[-1], generator=gen, device=dev)
        pair = (lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5))
        leaves = [x, w]
    elif name == "combine":  # shape: (tokens, top-k, latent)
        S, k, lat = shape
        x = torch.randn(S * k, lat, generator=gen, device=dev).to(torch.bfloat16)
        g = torch.randn(S, lat, generator=gen, device=dev)
        w = torch.rand(S, k, generator=gen, device=dev)
        order = torch.randperm(S * k, device=dev)
        pair = (lambda a, b: weighted_combine(a, order, b),
                lambda a, b: weighted_combine_reference(a, order, b))
        leaves = [x, w]
    elif name == "gated_rms_norm":
        w = 1 + 0.1 * torch.randn(shape[-1], generator=gen, device=dev)
        z = torch.randn(*shape, generator=gen, device=dev).to(torch.bfloat16)
        pair = (lambda a, b, c: gated_rms_norm(a, b, c, 1e-5),
                lambda a, b, c: gated_rms_norm_reference(a, b, c, 1e-5))
        leaves = [x, w, z]
    else:
        pair = (lambda a: l2_norm(a, 1e-6), lambda a: l2_norm_reference(a, 1e-6))
        leaves = [x]

    def run(fn, dtype, backward: bool = True):
        ls = _leaves(leaves, None)
        if dtype is not None:
            ls = [t.detach().to(dtype).requires_grad_() for t in ls]
        y = fn(*ls)
        return [y, *torch.autograd.grad(y, ls, g.to(y.dtype))] if backward else [y]

    kernel = functools.partial(run, pair[0], None)
    reference = functools.partial(run, pair[1], torch.float32)
    names = ["out", "d_x", "d_weight", "d_gate"][:len(leaves) + 1]
    errs = _errors(kernel(), reference(), names)
    times = {k: common.fwd_bwd_timing(ctx, fn) for k, fn in
             (("kernel", kernel), ("reference", reference)) if ctx.left() > 8}
    return errs, times


def _mx_case(ctx: common.Ctx, rows: int, cols: int) -> tuple[dict, dict]:
    """The MXFP8 cast of bf16 expert activations [rows, cols] along both axes (fprop's and
    wgrad's), both modes, plus a row of special values: bit-exact against the PyTorch
    quantiser on the same device, and ms of both (the cast has no backward)."""
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(rows, cols, generator=gen, device=dev).to(torch.bfloat16)
    x[0, :32] = 0
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3] *= 1e-30
    res: dict = {}
    for dim in (-1, 0):
        for mode in ("rceil", "floor"):
            d, s = mx_quantize(x, 32, dim, mode)
            d_ref, s_ref = _mx_quantize_reference(x, 32, dim % 2, mode)
            mism = (d.view(torch.uint8) != d_ref.view(torch.uint8)).sum().item()
            mism += (s.view(torch.uint8) != s_ref.view(torch.uint8)).sum().item()
            res[f"dim{dim}_{mode}_mismatched_bytes"] = int(mism)
    res["within_tol"] = all(v == 0 for k, v in res.items() if k.endswith("bytes"))
    times = {}
    for key, fn in (("kernel", lambda: mx_quantize(x, 32, 0, "rceil")),
                    ("reference", lambda: _mx_quantize_reference(x, 32, 0, "rceil"))):
        if ctx.left() > 8:
            times[key] = {"fwd_ms": common.best_ms(ctx, fn)["ms"]}
    return res, times


def main(ctx: common.Ctx, out: dict) -> bool:
    if ctx.cuda:  # the kernels, not a fallback: fail loudly if triton is unusable
        for var in BACKEND_VARS:
            os.environ.setdefault(var, "triton")
    attn = [(3, 64, 256)] if ctx.small else [(8, 2048, 4096), (8, 7168, 4096)]
    situ = (256, 96) if ctx.small else (4096 * 8, 1024)
    conv = (1, 256, 96) if ctx.small else (1, 4096, 4096)
    heads = (1, 256, 4, 32) if ctx.small else (1, 4096, 32, 128)
    out.update(attnres_cases=attn, situ_case=situ, conv_case=conv, l2_case=heads, tol=TOL,
               backends={k: os.environ.get(k, "auto") for k in BACKEND_VARS})
    timings: dict = {}
    ok = True
    for n, d, tokens in attn:
        key = f"attnres_n{n}_d{d}_t{tokens}"
        res = common.attempt(out, key, functools.partial(_attnres_case, ctx, n, d, tokens))
        if res is not None:
            out[key], timings[key] = res
            ok &= res[0]["within_tol"]
    res = common.attempt(out, "situ", functools.partial(_situ_case, ctx, *situ))
    if res is not None:
        out["situ"], timings["situ"] = res
        ok &= res[0]["within_tol"]
    combine = (64, 4, 96) if ctx.small else (4096, 8, 1024)
    for key, shape in (("short_conv", conv), ("rms_norm", conv), ("gated_rms_norm", heads),
                       ("l2_norm", heads), ("combine", combine)):
        res = common.attempt(out, key, functools.partial(_elementwise_case, ctx, key, shape))
        if res is not None:
            out[key], timings[key] = res
            ok &= res[0]["within_tol"]
    mx = (256, 96) if ctx.small else (4096 * 8, 1024)
    res = common.attempt(out, "mx_cast", functools.partial(_mx_case, ctx, *mx))
    if res is not None:
        out["mx_cast"], timings["mx_cast"] = res
        ok &= res[0]["within_tol"]
    out["within_tol"] = bool(ok) and not out.get("failed")
    out["timings"] = timings
    return True


if __name__ == "__main__":
    common.run_stage("fused", main)

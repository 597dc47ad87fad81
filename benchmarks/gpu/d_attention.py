"""Stage d (attention): `packed_causal_attention` on packed documents against a per-document
loop of `F.scaled_dot_product_attention(is_causal=True)` in fp32, forward and backward.

    python benchmarks/gpu/d_attention.py [--device cuda] [--small]

One row of T=8192 tokens holding 8 documents of uneven lengths, 16 heads (k3_small's MLA), qk
dim 192, v dim 128, softmax scale 192^-1/2, bf16 inputs (`--small`: T=512, 2 heads, 48 / 32).
Paths: "packed" (`packed_causal_attention` in bf16, whatever `attention_backend` picks: varlen
FlashAttention on CUDA), "blockwise" (the masked-SDPA reference path in bf16, if the module
still exports it), "sdpa_loop_bf16" (the per-document loop in bf16: what varlen replaces) and the
fp32 reference loop. Errors of o, dq, dk, dv against the reference; ms of forward and
forward+backward; peak extra memory of forward+backward (MiB).
"""

from __future__ import annotations

import functools

import gpu_common as common
import torch
import torch.nn.functional as F

import model.ops.attention as attention
from model.packing import Packing

TOL_NORM_REL = 1e-2


def doc_loop(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    """Per-document causal SDPA: [1, T, H, D] -> [1, T, H, Dv]."""
    outs, s = [], 0
    for n in lengths:
        sl = slice(s, s + n)
        outs.append(F.scaled_dot_product_attention(
            q[:, sl].transpose(1, 2), k[:, sl].transpose(1, 2), v[:, sl].transpose(1, 2),
            is_causal=True, scale=scale).transpose(1, 2))
        s += n
    return torch.cat(outs, dim=1)


def main(ctx: common.Ctx, out: dict) -> bool:
    dev = ctx.device
    if ctx.small:
        lengths, H, Dqk, Dv = [150, 100, 80, 60, 50, 40, 31, 1], 2, 48, 32
    else:
        lengths, H, Dqk, Dv = [3000, 1500, 1200, 900, 700, 500, 300, 92], 16, 192, 128
    T = sum(lengths)
    scale = Dqk**-0.5
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    packing = Packing.from_host(cu, 1, T, dev)
    backend = attention.attention_backend(dev, torch.bfloat16)
    out.update(T=T, lengths=lengths, H=H, qk_dim=Dqk, v_dim=Dv, backend=backend,
               tol_norm_rel=TOL_NORM_REL)
    if ctx.cuda and backend != "varlen":
        out.setdefault("failed", []).append("backend")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(1, T, H, Dqk, generator=gen, device=dev).to(torch.bfloat16)
            for _ in range(2))
    v = torch.randn(1, T, H, Dv, generator=gen, device=dev).to(torch.bfloat16)
    do = torch.randn(1, T, H, Dv, generator=gen, device=dev).to(torch.bfloat16)

    paths = {"packed": (lambda a, b, c: attention.packed_causal_attention(a, b, c, packing, scale),
                        torch.bfloat16),
             "sdpa_loop_bf16": (lambda a, b, c: doc_loop(a, b, c, lengths, scale),
                                torch.bfloat16),
             "ref_fp32": (lambda a, b, c: doc_loop(a, b, c, lengths, scale), torch.float32)}
    if hasattr(attention, "blockwise_attention"):
        paths["blockwise"] = (
            lambda a, b, c: attention.blockwise_attention(a, b, c, packing, scale),
            torch.bfloat16)

    def run(name: str, backward: bool = True):
        fn, dtype = paths[name]
        leaves = [x.detach().to(dtype, copy=True).requires_grad_() for x in (q, k, v)]
        o = fn(*leaves)
        if backward:
            o.backward(do.to(o.dtype))
        return o.detach(), [x.grad for x in leaves]

    ref = run("ref_fp32")
    names = ("o", "dq", "dk", "dv")
    for name in [p for p in paths if p != "ref_fp32"]:
        def errors(name=name) -> dict:
            o, grads = run(name)
            errs = {n: common.rel_err(a, b) for n, a, b in zip(names, [o, *grads],
                                                              [ref[0], *ref[1]])}
            return {**errs, "worst_norm_rel": common.worst(errs),
                    "within_tol": common.worst(errs) <= TOL_NORM_REL}
        common.attempt(out, f"errors_{name}", errors)
    ref = None  # free the reference before timing
    timings: dict = {}
    for name in paths:
        if ctx.left() < 8:
            common.skip(out, f"timing {name}")
            continue

        common.attempt(timings, name,
                       lambda name=name: common.fwd_bwd_timing(ctx, functools.partial(run, name)))
    return common.finish(out, timings, "errors_packed")


if __name__ == "__main__":
    common.run_stage("attention", main)

"""Stage b (kda): fla's chunk_kda (through our `chunk_kda`) against `chunk_kda_reference`.

    python benchmarks/gpu/b_kda.py [--device cuda] [--small]

One packed row of documents of lengths 1, 63, 64, 65 and 4000 (chunk 64; `--small`: 1, 63, 64,
65, 200), K3-like heads H=8, K=V=128 (`--small`: 2 heads of 32), q and k L2-normalised, gates
from K3's lower-bounded form (`model.ops.kda.kda_gate` with gate_lower_bound -5, A_log 0 and dt_bias
as initialised), beta = sigmoid. Two input dtypes: "bf16" (q, k, v bf16, g and beta fp32, as
`KimiDeltaAttention` passes them) and "fp32". The reference runs in fp32 on the same device on
the fp32 copies of the same values. Per case: the backend used; relative errors (max|d| / max|ref|
and ||d|| / ||ref||) of o, the per-document final states and the gradients of q, k, v, g, beta
for one fixed random dO; forward and backward ms of both (best of 3 after a warm-up; "first_ms"
is the first call: Triton compilation and autotuning). Case "gated" (what `KimiDeltaAttention`
runs): `chunk_kda(gate=)` on the raw bf16 projections (q/k unnormalised, gate pre-activation f,
beta logits b; fp32 A_log / dt_bias), the prologue inside fla, against `kda_prologue` +
`chunk_kda_reference` in fp32: errors of o and of dq, dk, dv, df, db, dA_log, ddt_bias, and ms
against the unfused path (`kda_prologue` in PyTorch, then fla's plain `chunk_kda`). Prints one
JSON line.
"""

from __future__ import annotations

import inspect
import math
import time

import gpu_common as common
import torch
import torch.nn.functional as F

from model.ops.kda import (
    KDAGate,
    chunk_kda,
    chunk_kda_reference,
    kda_backend,
    kda_gate,
    kda_prologue,
)

CHUNK = 64
TOL = {"bf16": 2e-2, "fp32": 5e-3, "gated": 2e-2}  # norm_rel of every output and gradient


def make_inputs(lengths: list[int], H: int, D: int, dev: torch.device, seed: int = 0):
    T = sum(lengths)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    q = F.normalize(rnd(1, T, H, D), dim=-1)
    k = F.normalize(rnd(1, T, H, D), dim=-1)
    v = rnd(1, T, H, D)
    A_log = torch.zeros(H, device=dev)  # K3's init with the lower-bounded gate
    u = torch.rand(H * D, generator=gen, device=dev)
    dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as model.init does
    g = kda_gate(rnd(1, T, H, D), A_log, dt_bias, -5.0)  # [1, T, H, D] fp32 in [-5, 0)
    beta = torch.sigmoid(rnd(1, T, H))
    do = rnd(1, T, H, D)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    return [q, k, v, g, beta], do, cu


def make_raw(lengths: list[int], H: int, D: int, dev: torch.device, seed: int = 1):
    """The layer's raw projections: bf16 q, k (unnormalised), v, f, b; fp32 A_log, dt_bias."""
    T = sum(lengths)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    u = torch.rand(H * D, generator=gen, device=dev)
    dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    bf16 = [rnd(1, T, H, D).bfloat16() for _ in range(4)] + [rnd(1, T, H).bfloat16()]
    do = rnd(1, T, H, D).bfloat16()
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    return [*bf16, torch.zeros(H, device=dev), dt_bias], do, cu


def gated(q, k, v, f, b, A_log, dt_bias, **kw):
    return chunk_kda(q, k, v, f, b, gate=KDAGate(A_log, dt_bias, -5.0), **kw)


def gated_reference(q, k, v, f, b, A_log, dt_bias, **kw):
    q, k, g, beta = kda_prologue(q, k, f, b, KDAGate(A_log, dt_bias, -5.0))
    return chunk_kda_reference(q, k, v, g, beta, **kw)


def unfused(q, k, v, f, b, A_log, dt_bias, **kw):
    q, k, g, beta = kda_prologue(q, k, f, b, KDAGate(A_log, dt_bias, -5.0))
    return chunk_kda(q, k, v, g, beta, **kw)


def fwd_bwd(fn, inputs: list[torch.Tensor], do: torch.Tensor, kw: dict):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, _ = fn(*leaves, **kw)
    o.backward(do.to(o.dtype))
    return o.detach(), [x.grad for x in leaves]


def fwd_only(fn, inputs: list[torch.Tensor], kw: dict) -> None:
    leaves = [x.detach().requires_grad_() for x in inputs]  # as in training: a graph is built
    fn(*leaves, **kw)


def case(ctx: common.Ctx, dtype_name: str, lengths: list[int], H: int, D: int) -> dict:
    dev = ctx.device
    ours, ref, names = chunk_kda, chunk_kda_reference, ["dq", "dk", "dv", "dg", "dbeta"]
    if dtype_name == "gated":
        xs, do, cu = make_raw(lengths, H, D, dev)
        ours, ref, names = gated, gated_reference, ["dq", "dk", "dv", "df", "db", "dA_log",
                                                    "ddt_bias"]
    else:
        xs, do, cu = make_inputs(lengths, H, D, dev)
    if dtype_name == "bf16":  # q, k, v in bf16; g, beta fp32 (what the model passes)
        xs = [x.to(torch.bfloat16) for x in xs[:3]] + xs[3:]
        do = do.to(torch.bfloat16)
    ref_in = [x.float() for x in xs]  # the same values, in fp32
    res: dict = {"backend": kda_backend(dev), "T": sum(lengths)}
    kw = {"cu_seqlens": cu.to(dev), "chunk_size": CHUNK}
    if "cu_seqlens_cpu" in inspect.signature(chunk_kda).parameters:
        kw["cu_seqlens_cpu"] = cu  # the host copy: no device read inside fla
    res["cu_seqlens_cpu_passed"] = "cu_seqlens_cpu" in kw
    ref_kw = {"cu_seqlens": cu.to(dev), "chunk_size": CHUNK}

    ctx.sync()
    t = time.perf_counter()
    o, grads = fwd_bwd(ours, xs, do, kw)  # the first call: Triton compiles and autotunes
    ctx.sync()
    res["first_fwd_bwd_s"] = time.perf_counter() - t
    o_ref, grads_ref = fwd_bwd(ref, ref_in, do.float(), ref_kw)
    errs = {"o": common.rel_err(o, o_ref)}
    errs.update({n: common.rel_err(a, b) for n, a, b in zip(names, grads, grads_ref)})
    with torch.no_grad():
        _, s = ours(*xs, output_final_state=True, **kw)
        _, s_ref = ref(*ref_in, output_final_state=True, **ref_kw)
    errs["final_state"] = common.rel_err(s, s_ref)
    res["errors"] = errs
    res["worst_norm_rel"] = common.worst(errs)
    res["within_tol"] = res["worst_norm_rel"] <= TOL[dtype_name]
    del o, grads, o_ref, grads_ref

    timed = [("ours", ours, xs, do, kw), ("ref", ref, ref_in, do.float(), ref_kw)]
    if dtype_name == "gated":  # the prologue in PyTorch, then fla's plain kernels
        timed.insert(1, ("unfused", unfused, xs, do, kw))
    for name, fn, inp, d, k in timed:
        if ctx.left() < 10:
            common.skip(res, f"{name} timing")
            continue
        f = common.best_ms(ctx, lambda fn=fn, inp=inp, k=k: fwd_only(fn, inp, k))
        fb = common.best_ms(ctx, lambda fn=fn, inp=inp, d=d, k=k: fwd_bwd(fn, inp, d, k))
        res[f"{name}_fwd_ms"] = f["ms"]
        res[f"{name}_fwd_bwd_ms"] = fb["ms"]
        res[f"{name}_bwd_ms"] = fb["ms"] - f["ms"]
        res[f"{name}_first_fwd_bwd_ms"] = fb["first_ms"]
    return res


def main(ctx: common.Ctx, out: dict) -> bool:
    if ctx.small:
        lengths, H, D = [1, 63, 64, 65, 200], 2, 32
    else:
        lengths, H, D = [1, 63, 64, 65, 4000], 8, 128
    out.update(lengths=lengths, H=H, K=D, V=D, chunk_size=CHUNK, gate="K3 lower bound -5",
               backend=kda_backend(ctx.device), tol_norm_rel=TOL)
    if ctx.cuda and out["backend"] != "fla":
        out.setdefault("failed", []).append("backend")
        out["backend_error"] = "kda_backend(cuda) is not 'fla': fla did not import"
    for dtype_name in ("gated", "bf16", "fp32"):  # gated first: what the model runs
        if ctx.left() < 15:
            common.skip(out, dtype_name)
            continue
        common.attempt(out, dtype_name, lambda d=dtype_name: case(ctx, d, lengths, H, D))
    out["within_tol"] = all(isinstance(out.get(d), dict) and out[d].get("within_tol")
                            for d in ("gated", "bf16", "fp32"))
    return True


if __name__ == "__main__":
    common.run_stage("kda", main)

"""Stage e (loss): `chunked_cross_entropy` in bf16 against `F.cross_entropy` on fp32 logits.

    python benchmarks/gpu/e_loss.py [--device cuda] [--small]

K3 vocabulary 163840, hidden 2048 (k3_small), 8192 tokens, 3% of labels ignored (-100); h and
the head weight in bf16 (std 1 and 0.02, as initialised), chunk 4096 tokens (the model's
`loss_chunk_tokens`). `--small`: vocab 1000, hidden 64, 256 tokens. The reference is the summed
`F.cross_entropy` of fp32 logits computed from the same bf16 values in fp32. Reports the loss
sums and their relative difference, errors of dh and dW, ms of forward and forward+backward
and peak extra memory for: chunked (bf16; its logit gradient on `ce_backend`, our Triton
kernel on CUDA), "chunked_torch_grad" (the same with the logit gradient's PyTorch form,
`K3_CE_BACKEND=torch`), the fp32 reference, and "naive_bf16" (F.cross_entropy over bf16 logits
cast to fp32: what chunking avoids).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import gpu_common as common
import torch
import torch.nn.functional as F

from model.loss import IGNORE_INDEX, chunked_cross_entropy
from model.ops.backends import fused_backend

TOL = {"loss_rel": 1e-3, "grad_norm_rel": 2e-2}


@contextlib.contextmanager
def ce_backend(mode: str | None) -> Iterator[None]:
    """K3_CE_BACKEND=mode inside (None: as it is)."""
    old = os.environ.get("K3_CE_BACKEND")
    if mode is not None:
        os.environ["K3_CE_BACKEND"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("K3_CE_BACKEND", None)
        else:
            os.environ["K3_CE_BACKEND"] = old


def main(ctx: common.Ctx, out: dict) -> bool:
    dev = ctx.device
    N, d, V, chunk = (256, 64, 1000, 96) if ctx.small else (8192, 2048, 163840, 4096)
    out.update(tokens=N, hidden=d, vocab=V, chunk_tokens=chunk, tol=TOL,
               ce_backend=fused_backend(dev, torch.bfloat16, "K3_CE_BACKEND"))
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(N, d, generator=gen, device=dev).to(torch.bfloat16)
    w = (0.02 * torch.randn(V, d, generator=gen, device=dev)).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=gen, device=dev)
    drop = torch.rand(N, generator=gen, device=dev) < 0.03
    labels = torch.where(drop, torch.full_like(labels, IGNORE_INDEX), labels)

    def chunked():
        return chunked_cross_entropy(*leaves(torch.bfloat16), labels, chunk_tokens=chunk)[0]

    def chunked_torch_grad():  # run() sets K3_CE_BACKEND=torch around forward + backward
        return chunked()

    def reference():
        hh, ww = leaves(torch.float32)
        return F.cross_entropy(hh @ ww.t(), labels, reduction="sum", ignore_index=IGNORE_INDEX)

    def naive_bf16():
        hh, ww = leaves(torch.bfloat16)
        return F.cross_entropy((hh @ ww.t()).float(), labels, reduction="sum",
                               ignore_index=IGNORE_INDEX)

    cur: list[torch.Tensor] = []

    def leaves(dtype: torch.dtype) -> list[torch.Tensor]:
        cur[:] = [x.detach().to(dtype, copy=True).requires_grad_() for x in (h, w)]
        return list(cur)

    def run(fn, backward: bool = True):
        with ce_backend("torch" if fn is chunked_torch_grad else None):
            loss = fn()
            if backward:
                loss.backward()
        return loss.detach(), [x.grad for x in cur]

    paths = {"chunked": chunked, "chunked_torch_grad": chunked_torch_grad,
             "reference_fp32": reference, "naive_bf16": naive_bf16}
    ref_loss, (ref_dh, ref_dw) = run(reference)
    out["reference_loss_mean"] = float(ref_loss) / int((labels != IGNORE_INDEX).sum())
    for name in ("chunked", "chunked_torch_grad", "naive_bf16"):
        def errors(name=name) -> dict:
            loss, (dh, dw) = run(paths[name])
            errs = {"dh": common.rel_err(dh, ref_dh), "dw": common.rel_err(dw, ref_dw)}
            res = {"loss_sum": float(loss), "reference_loss_sum": float(ref_loss),
                   "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                   **errs, "worst_grad_norm_rel": common.worst(errs)}
            res["within_tol"] = (res["loss_rel"] <= TOL["loss_rel"]
                                 and res["worst_grad_norm_rel"] <= TOL["grad_norm_rel"])
            return res
        common.attempt(out, f"errors_{name}", errors)
    ref_dh = ref_dw = None
    cur.clear()
    timings: dict = {}
    for name, fn in paths.items():
        if ctx.left() < 8:
            common.skip(out, f"timing {name}")
            continue

        def timing(fn=fn) -> dict:
            t = common.fwd_bwd_timing(ctx, functools.partial(run, fn))
            cur.clear()
            return t

        common.attempt(timings, name, timing)
    return common.finish(out, timings, "errors_chunked")


if __name__ == "__main__":
    common.run_stage("loss", main)

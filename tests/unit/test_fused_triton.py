"""Our Triton kernels (AttnRes mix, SiTU-GLU, short conv, row norms, MoE combine, the
cross-entropy logit gradient, the router's QB statistics) under TRITON_INTERPRET=1.

One subprocess (the variable must be set before triton.jit runs) with K3_ATTNRES_BACKEND,
K3_SITU_BACKEND, K3_CONV_BACKEND, K3_NORM_BACKEND, K3_COMBINE_BACKEND, K3_CE_BACKEND,
K3_ROUTER_STATS_BACKEND and K3_GROUPED_WGRAD_BACKEND forced to "triton"
runs the model's ops forward and backward on CPU tensors and compares them with the
autograd-differentiated reference formulas in float64 (`*_reference`; independent of the
kernels' hand-written backward). AttnRes shapes cover no snapshots, K3's 8
snapshots (9 sources, 16 lanes), d not a power of two and wider than one d-tile, and more rows
than backward programs (the strided row loop and its masked tail); SiTU covers 1e-9 .. 3e2 and
both signs (the written-out tanh); the conv covers K 2 and 4, documents that reset inside a
row, row ends, channels not a multiple of the tile and several row tiles (the weight-gradient
partials); the norms (RMSNorm with its weight, sigmoid-gated, L2 without) cover d over one
4096-wide tile and
the strided backward rows; the logit gradient two vocabulary blocks (the second partial) and
ignored rows, against float64 softmax, and the chunked loss on it (4 chunks and 1) against
F.cross_entropy; the router statistics must equal the PyTorch reference's integer counts
exactly (experts not a power of two, several token blocks, a NaN row); the grouped weight
gradient, through `grouped_mm`'s backward into a buffer over two micro-batches, a per-expert
float64 loop (an empty expert, widths not tile multiples). All against float64.
The script asserts every kernel actually ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json
import torch
import torch.nn.functional as F
from model.loss import chunked_cross_entropy
from model.balancing import expert_loads, margin_histogram
from model.moe import record_router_stats
from model.ops import (attnres_triton, ce_grad_triton, combine_triton, grouped_wgrad_triton,
                       rms_norm_triton, router_stats_triton, short_conv_triton, situ_triton)
from model.ops.grouped_gemm import grouped_mm
from model.ops.ce_grad import ce_logit_grad
from model.ops.combine import weighted_combine, weighted_combine_reference
from model.ops.rms_norm import (gated_rms_norm, gated_rms_norm_reference, l2_norm,
                                l2_norm_reference, rms_norm, rms_norm_reference)
from model.ops.attnres import attnres_mix, attnres_mix_reference
from model.ops.short_conv import short_conv_silu, short_conv_silu_reference
from model.ops.situ import situ_glu, situ_glu_reference

calls = {}
def counted(mod, name):
    fn = getattr(mod, name)
    def wrapper(*a, **k):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **k)
    setattr(mod, name, wrapper)
for mod, names in ((attnres_triton, ("mix_fwd", "mix_bwd")),
                   (situ_triton, ("situ_fwd", "situ_bwd")),
                   (short_conv_triton, ("conv_fwd", "conv_bwd")),
                   (rms_norm_triton, ("norm_fwd", "norm_bwd")),
                   (combine_triton, ("combine_fwd", "combine_bwd")),
                   (ce_grad_triton, ("ce_grad",)),
                   (router_stats_triton, ("router_stats",)),
                   (grouped_wgrad_triton, ("grouped_wgrad_accumulate",))):
    for n in names:
        counted(mod, n)

def rel(a, b):
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))

def compare(key, fn, ref_fn, leaves):
    # fn(*leaves) and its gradients against ref_fn in float64; the worst relative error to key
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = ref_fn(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    worst[key] = max(worst.get(key, 0.0), rel(out, ref),
                     *(rel(a, b) for a, b in zip(grads, ref_grads)))
    return out, grads

torch.manual_seed(0)
worst = {}
for n, B, T, d in [(0, 1, 3, 8), (2, 2, 5, 16), (8, 1, 3, 40), (1, 1, 3, 1100)]:
    for dtype in (torch.float32, torch.bfloat16):
        scale = torch.logspace(-1, 1, n + 1)[:, None, None, None]
        src = (torch.randn(n + 1, B, T, d) * scale).to(dtype)
        w, q = torch.rand(d) + 0.5, torch.randn(d) * 0.2
        leaves = [src[:-1].clone().requires_grad_(), src[-1].clone().requires_grad_(),
                  w.clone().requires_grad_(), q.clone().requires_grad_()]
        out = attnres_mix(*leaves, 1e-5)
        g = torch.randn(B, T, d).to(dtype)
        grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        rb, rx, rw, rq = ref_leaves
        ref = attnres_mix_reference(torch.cat([rb, rx[None]]), rw * rq, 1e-5)
        ref_grads = torch.autograd.grad(ref, ref_leaves, g.double(), allow_unused=True)
        errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, ref_grads)
                                  if a is not None and a.numel() and b is not None]
        key = f"attnres {dtype}"
        worst[key] = max(worst.get(key, 0.0), *errs)
        assert out.dtype == dtype and grads[0].dtype == dtype

for dtype in (torch.float32, torch.bfloat16):
    mag = torch.logspace(-9, 2.5, 2000)
    g = (torch.randn(2000) * mag).to(dtype).requires_grad_()
    u = (torch.randn(2000) * mag.flip(0)).to(dtype).requires_grad_()
    out = situ_glu(g, u)
    do = torch.randn(2000).to(dtype)
    grads = torch.autograd.grad(out, (g, u), do)
    rg, ru = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = situ_glu_reference(rg, ru)
    ref_grads = torch.autograd.grad(ref, (rg, ru), do.double())
    # elementwise relative error (each element is its own kernel lane)
    elem = lambda a, b: float(((a.double() - b).abs() / b.abs().clamp_min(1e-12)).max()
                              if torch.isfinite(a).all() else float("inf"))
    worst[f"situ {dtype}"] = max(elem(out, ref), *(elem(a, b) for a, b in zip(grads, ref_grads)))
for B, T, C, K in [(2, 10, 8, 4), (1, 70, 100, 4), (3, 33, 64, 2)]:
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(B, T, C).to(dtype), 0.5 * torch.randn(C, K)
        # rows with documents of 30% / 50% of the row and one whole row; row ends cut taps too
        pos = torch.stack([torch.arange(T).remainder(int(T * f) + 1) for f in (0.3, 0.5, 1.0)][:B])
        compare(f"conv {dtype}", lambda a, b: short_conv_silu(a, b, pos),
                lambda a, b: short_conv_silu_reference(a, b, pos), [x, w])
for shape in [(3, 5, 16), (7, 300), (5, 5000)]:
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(shape) * 3).to(dtype)
        w = 1 + 0.3 * torch.randn(shape[-1])
        z = (torch.randn(shape) * 2).to(dtype)
        for name, fn, ref_fn, leaves in (
                ("rms", lambda a, b: rms_norm(a, b, 1e-5),
                 lambda a, b: rms_norm_reference(a, b, 1e-5), [x, w]),
                # the float64 reference of the gated norm: no rounding before the gate
                ("gated", lambda a, b, c: gated_rms_norm(a, b, c, 1e-5),
                 lambda a, b, c: gated_rms_norm_reference(a, b, c, 1e-5), [x, w, z]),
                ("l2", lambda a: l2_norm(a, 1e-6), lambda a: l2_norm_reference(a, 1e-6), [x])):
            compare(f"norm {dtype}", fn, ref_fn, leaves)
for S, k, l in [(5, 2, 8), (37, 8, 300), (3, 1, 20)]:  # tokens over one tile, l over one tile
    for dtype in (torch.float32, torch.bfloat16):
        order = torch.randperm(S * k)
        out, grads = compare(f"combine {dtype}", lambda a, b: weighted_combine(a, order, b),
                             lambda a, b: weighted_combine_reference(a, order, b),
                             [torch.randn(S * k, l).to(dtype), torch.rand(S, k)])
        assert out.dtype == torch.float32 and grads[0].dtype == dtype
n, V = 37, 5000  # two vocabulary blocks, the second partial; ignored rows
labels = torch.randint(0, V, (n,))
labels[::5] = -100
for dtype in (torch.float32, torch.bfloat16):
    logits = torch.randn(n, V) * 4
    scale = torch.rand(n) * (labels != -100)
    out = ce_logit_grad(logits, torch.logsumexp(logits, 1), labels, scale, dtype)
    ref = torch.softmax(logits.double(), 1)  # the oracle: softmax minus onehot, times scale
    hit = labels >= 0
    ref[torch.arange(n)[hit], labels[hit]] -= 1.0
    ref = ref * scale.double()[:, None]
    assert out.dtype == dtype
    worst[f"ce {dtype}"] = float(((out.double() - ref).abs()
                                  / (ref.abs() + scale.double()[:, None] / V)
                                  .clamp_min(1e-30)).max())  # ignored rows: 0 and 0
# the chunked loss on the kernel path (4 chunks, then 1) against F.cross_entropy in float64
h = torch.randn(50, 16)
w = torch.randn(V, 16) * 0.3
y = torch.randint(0, V, (50,))
y[::7] = -100
for chunk in (16, 64):
    compare("ce loss", lambda a, b: chunked_cross_entropy(a, b, y, chunk_tokens=chunk)[0],
            lambda a, b: F.cross_entropy(a @ b.T, y, ignore_index=-100, reduction="sum"),
            [h, w])
# the router's QB statistics: exactly the reference's histogram and loads (integers), with
# rows of non-finite scores left out; several token blocks, experts not a power of two
mismatch = 0
for S, E, k, bins in [(37, 64, 8, 1000), (70, 130, 2, 7), (3, 5, 4, 50)]:
    scores = torch.sigmoid(torch.randn(S, E) * 2)
    scores[1, 2] = float("nan")
    bias = torch.randn(E) * 0.05
    idx = torch.topk(scores + bias, k, dim=1).indices
    counts = torch.full((E, bins), 3, dtype=torch.long)  # adds to what is there
    load = torch.full((E,), 5, dtype=torch.long)
    record_router_stats(counts, load, scores, bias, idx, k)
    want = 3 + margin_histogram(scores, bias, k, bins)
    mismatch += int((counts != want).sum()) + int((load != 5 + expert_loads(idx, E, scores)).sum())
    assert int(counts.sum()) == 3 * E * bins + (S - 1) * E  # the NaN row is not counted
worst["router stats mismatches"] = mismatch
# the experts' weight gradient added into an fp32 buffer (gradient-accumulation fusion): through
# grouped_mm's backward, twice (two micro-batches), against a per-expert float64 loop; an empty
# expert, one with more rows than a K step, widths that are not tile multiples (16-byte rows,
# as _grouped_mm needs)
for sizes, out_f, in_f in [([5, 0, 23, 40], 24, 40), ([1, 17], 48, 16)]:
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(len(sizes), out_f, in_f).to(dtype).requires_grad_()
        buf = torch.randn(len(sizes), out_f, in_f)
        want = buf.double().clone()
        for _ in range(2):
            x = torch.randn(sum(sizes), in_f).to(dtype)
            dy = torch.randn(sum(sizes), out_f).to(dtype)
            grouped_mm(x, w, torch.tensor(sizes), main_grad=buf).backward(dy)
            start = 0
            for e, n in enumerate(sizes):
                want[e] += dy[start:start + n].double().t() @ x[start:start + n].double()
                start += n
        assert w.grad is None and buf.dtype == torch.float32
        worst[f"grouped wgrad {dtype}"] = max(worst.get(f"grouped wgrad {dtype}", 0.0),
                                              rel(buf, want))
print(json.dumps({"worst": worst, "calls": calls}))
"""


def test_triton_kernels_interpreted() -> None:
    pytest.importorskip("triton", reason="triton not installed: the Triton kernels are untested")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT),
               K3_ATTNRES_BACKEND="triton", K3_SITU_BACKEND="triton", K3_CONV_BACKEND="triton",
               K3_NORM_BACKEND="triton", K3_COMBINE_BACKEND="triton", K3_CE_BACKEND="triton",
               K3_ROUTER_STATS_BACKEND="triton", K3_GROUPED_WGRAD_BACKEND="triton")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    worst, calls = out["worst"], out["calls"]
    assert calls == {"mix_fwd": 8, "mix_bwd": 8, "situ_fwd": 2, "situ_bwd": 2, "conv_fwd": 6,
                     "conv_bwd": 6, "norm_fwd": 18, "norm_bwd": 18,
                     "combine_fwd": 6, "combine_bwd": 6, "ce_grad": 7, "router_stats": 3,
                     "grouped_wgrad_accumulate": 8}, calls
    assert worst["attnres torch.float32"] < 2e-5, worst
    assert worst["attnres torch.bfloat16"] < 2e-2, worst  # bf16 outputs: ~2^-8 rounding
    assert worst["situ torch.float32"] < 5e-6, worst
    assert worst["situ torch.bfloat16"] < 1e-2, worst
    assert worst["conv torch.float32"] < 1e-5, worst
    assert worst["conv torch.bfloat16"] < 2e-2, worst
    assert worst["norm torch.float32"] < 1e-5, worst
    assert worst["norm torch.bfloat16"] < 2e-2, worst
    assert worst["combine torch.float32"] < 1e-5, worst
    assert worst["combine torch.bfloat16"] < 2e-2, worst
    assert worst["ce torch.float32"] < 1e-5, worst
    assert worst["ce torch.bfloat16"] < 1e-2, worst
    assert worst["ce loss"] < 1e-5, worst
    assert worst["router stats mismatches"] == 0, worst
    assert worst["grouped wgrad torch.float32"] < 1e-5, worst
    assert worst["grouped wgrad torch.bfloat16"] < 1e-5, worst  # exact products, fp32 sums

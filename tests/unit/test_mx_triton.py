"""Our MXFP8 cast kernel (`model.ops.mx_triton`, op `k3::mx_cast`) under TRITON_INTERPRET=1,
bit for bit against the PyTorch quantiser (`model.ops.mx._mx_quantize_reference` and
`mx_dequantize`), through the public `mx_quantize` / `fake_quantize_mx` with
K3_MX_CAST_BACKEND=triton.

Cases: both scale modes; blocks along the last dim, a middle dim and dim 0; fp32 and bf16
inputs; zero blocks, -0.0, NaN and Inf blocks, subnormal and huge magnitudes, amax exactly at
448 * 2^k and at the 1.75-mantissa boundary of "rceil" (and one float either side), and values
exactly halfway between e4m3 codes (round half to even). One subprocess (the variable must be
set before triton.jit runs); the script asserts the kernel ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import torch
from model.ops import mx_triton
from model.ops.mx import _mx_quantize_reference, fake_quantize_mx, mx_dequantize, mx_quantize

calls = [0]
real = mx_triton.mx_cast
def counted(*a, **k):
    calls[0] += 1
    return real(*a, **k)
mx_triton.mx_cast = counted

def same(a, b):  # bitwise, NaNs included
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8),
                                                                      b.view(torch.uint8))

def special_rows():
    rows = []
    r = torch.randn(32); r[:] = 0; rows.append(r)                       # zero block
    r = torch.randn(32); r[0] = -0.0; r[1:] = 0; rows.append(r)         # -0.0 kept
    r = torch.randn(32); r[7] = float("nan"); rows.append(r)            # NaN block
    r = torch.randn(32); r[3] = float("-inf"); r[4] = 3e38; rows.append(r)  # Inf block
    rows.append(torch.randn(32) * 1e-39)                                # subnormal amax
    rows.append(torch.randn(32) * 1e-30)
    rows.append(torch.randn(32) * 3e37)
    for k in (-20, 0, 5):                                               # amax = 448 * 2^k
        r = torch.rand(32) * 400 * 2.0**k; r[9] = 448 * 2.0**k; rows.append(r)
    for m in (1.75, 1.7500001, 1.7499999):                              # rceil's boundary
        r = torch.rand(32); r[2] = m * 8; rows.append(r)
    codes = torch.tensor([2.0**-9 * i for i in range(8)]
                         + [2.0**-6 * (1 + j / 8) for j in range(8)])
    ties = (codes[1:] + codes[:-1]) / 2                                 # exactly halfway
    r = torch.zeros(32); r[:15] = ties; r[15] = 448.0; r[16:31] = -ties; rows.append(r)
    r = torch.zeros(32); r[:15] = ties * 2**8; r[15] = 448.0; rows.append(r)
    return torch.stack(rows)  # [n, 32]

torch.manual_seed(0)
spec = special_rows()
mixed = torch.randn(spec.shape[0], 96) * torch.logspace(-30, 30, spec.shape[0])[:, None]
mixed[:, 32:64] = spec
cases = [(spec, -1), (mixed, -1), (mixed.t().contiguous(), 0),
         (torch.randn(3, 64, 5) * 10, 1), (torch.randn(4, 64).bfloat16(), -1),
         (torch.randn(64, 3).bfloat16() * 1e-3, 0)]
checked = 0
for x, dim in cases:
    for mode in ("rceil", "floor"):
        d_ref, s_ref = _mx_quantize_reference(x, 32, dim % x.ndim, mode)
        d, s = mx_quantize(x, 32, dim, mode)
        assert same(d, d_ref), (tuple(x.shape), dim, mode, "data")
        assert same(s, s_ref), (tuple(x.shape), dim, mode, "scale")
        f = fake_quantize_mx(x, dim, mode)
        assert same(f, mx_dequantize(d_ref, s_ref, 32, dim % x.ndim, x.dtype)), (dim, mode)
        checked += 1
leaf = torch.randn(8, 64, requires_grad=True)  # straight-through gradient around the kernel
fake_quantize_mx(leaf, -1).sum().backward()
assert torch.equal(leaf.grad, torch.ones_like(leaf))
assert calls[0] == 2 * checked + 1, calls  # mx_quantize, fake_quantize_mx, the leaf
print("checked", checked, "kernel calls", calls[0])
"""


def test_mx_cast_kernel_bit_exact_interpreted() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", K3_MX_CAST_BACKEND="triton",
               PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked 12" in proc.stdout, proc.stdout

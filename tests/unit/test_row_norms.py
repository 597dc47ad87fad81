"""The row norms (`model.ops.rms_norm`): references against direct float64 formulas, and the
custom op k3::row_norm (plain, sigmoid-gated, L2; what CUDA and fake traces run; off CUDA its
backward is written out) against finite differences. The Triton kernels:
tests/unit/test_fused_triton.py."""

import math

import torch

from model.ops.rms_norm import _norm_op, l2_norm_reference, rms_norm_reference


def test_references_match_direct_formulas():
    x = torch.randn(3, 7, dtype=torch.float64) * 4
    w = torch.randn(7, dtype=torch.float64)
    for i in range(3):
        row = x[i].tolist()
        rms = math.sqrt(sum(v * v for v in row) / 7 + 1e-5)
        l2 = math.sqrt(sum(v * v for v in row) + 1e-6)
        torch.testing.assert_close(rms_norm_reference(x, w, 1e-5)[i], x[i] / rms * w)
        torch.testing.assert_close(l2_norm_reference(x, 1e-6)[i], x[i] / l2)


def test_custom_op_gradcheck_and_forward():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _norm_op(a, b, None, 1e-5, True)[0], (x, w))
    assert torch.autograd.gradcheck(lambda a: _norm_op(a, None, None, 1e-6, False)[0], (x,))
    torch.testing.assert_close(_norm_op(x, w, None, 1e-5, True)[0],
                               rms_norm_reference(x, w, 1e-5))
    torch.testing.assert_close(_norm_op(x, None, None, 1e-6, False)[0],
                               l2_norm_reference(x, 1e-6))
    z = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: _norm_op(a, b, c, 1e-5, True)[0], (x, w, z))
    torch.testing.assert_close(_norm_op(x, w, z, 1e-5, True)[0],
                               rms_norm_reference(x, w, 1e-5) * torch.sigmoid(z))
    assert _norm_op(x.float(), w.float(), None, 1e-5, True)[1].dtype == torch.float32

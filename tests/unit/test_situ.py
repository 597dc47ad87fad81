import torch

from model.ops.situ import situ_glu


def _reference(g: torch.Tensor, u: torch.Tensor, b1: float = 4.0, b2: float = 25.0):
    """Direct float64 formula (§4.3)."""
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) / (1 + torch.exp(-g)) * (b2 * torch.tanh(u / b2))


def test_matches_formula_and_keeps_dtype():
    g, u = torch.randn(64, 32) * 5, torch.randn(64, 32) * 50
    out = situ_glu(g, u)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(g, u), rtol=1e-6, atol=1e-6)
    assert situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16


def test_bounded_by_100():
    g = torch.linspace(-1e4, 1e4, 20001, dtype=torch.float64)
    out = situ_glu(g[:, None], g[None, ::50])
    assert out.abs().max() <= 100.0  # tanh saturates to exactly 1 in floating point
    assert out.max() > 95.0  # the bound is approached, so the check is meaningful
    mid = torch.linspace(-60, 60, 1201, dtype=torch.float64)
    assert situ_glu(mid[:, None], mid[None, :]).abs().max() < 100.0


def test_equals_swiglu_to_third_order_near_zero():
    """SiTU(g) = silu(g) - g^3 sigmoid(g) / (3 b1^2) + ..., so the GLU differs from SwiGLU by a
    term of total degree 4: shrinking the inputs 10x shrinks the difference ~10^4x."""
    g0 = torch.randn(1000, dtype=torch.float64)
    u0 = torch.randn(1000, dtype=torch.float64)

    def err(eps):
        g, u = g0 * eps, u0 * eps
        return (situ_glu(g, u) - torch.nn.functional.silu(g) * u).abs().max().item()

    e1, e2 = err(1e-1), err(1e-2)
    assert 0 < e1 < 1e-3
    assert 5e3 < e1 / e2 < 2e4, (e1, e2)
    big = torch.tensor([10.0], dtype=torch.float64)
    assert (situ_glu(big, big) - torch.nn.functional.silu(big) * big).abs() > 1  # not SwiGLU


def test_gradcheck_and_analytic_gradient():
    g = torch.randn(6, 5, dtype=torch.float64, requires_grad=True) * 3
    u = torch.randn(6, 5, dtype=torch.float64, requires_grad=True) * 30
    g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
    assert torch.autograd.gradcheck(situ_glu, (g, u))
    situ_glu(g, u).sum().backward()
    s = torch.sigmoid(g.detach())
    t = torch.tanh(g.detach() / 4)
    dsitu = (1 - t**2) * s + 4 * t * s * (1 - s)  # §4.3's derivative
    cap = 25 * torch.tanh(u.detach() / 25)
    torch.testing.assert_close(g.grad, dsitu * cap)
    torch.testing.assert_close(u.grad, 4 * t * s * (1 - torch.tanh(u.detach() / 25) ** 2))


def test_custom_op_gradcheck_off_cuda():
    """k3::situ_glu itself (what CUDA and fake traces run; off CUDA its body is the reference and
    its backward the recomputing PyTorch formula) against finite differences."""
    from model.ops.situ import _situ_op

    g = (torch.randn(5, 4, dtype=torch.float64) * 3).requires_grad_()
    u = (torch.randn(5, 4, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _situ_op(a, b, 4.0, 25.0), (g, u))
    torch.testing.assert_close(_situ_op(g, u, 4.0, 25.0), _reference(g, u))

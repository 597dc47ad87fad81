import torch

from model.ops.situ import situ_glu


def _reference(g: torch.Tensor, u: torch.Tensor, b1: float = 4.0, b2: float = 25.0):
    """Direct float64 formula (§4.3)."""
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) / (1 + torch.exp(-g)) * (b2 * torch.tanh(u / b2))


def test_matches_formula_and_keeps_dtype():
    from model.ops.situ import situ_glu_reference

    g, u = torch.randn(64, 32) * 5, torch.randn(64, 32) * 50
    torch.testing.assert_close(situ_glu_reference(g, u).double(), _reference(g, u), rtol=1e-6,
                               atol=1e-6)
    g.requires_grad_()
    out = situ_glu(g, u)  # CPU fp32: the sigmoid-based path, absolute error ~1e-7 of b1 b2
    assert out.dtype == torch.float32 and type(out.grad_fn).__name__ == "_SituCPUBackward"
    torch.testing.assert_close(out.double(), _reference(g, u), rtol=1e-6, atol=3e-5)
    assert situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16


def test_cpu_path_gradients_match_float64_formula():
    """The CPU fast path's saved derivative factors against float64 autograd of the formula,
    over the whole range (saturated tails included), in fp32 and bf16."""
    gen = torch.Generator().manual_seed(3)
    g0 = torch.randn(256, 48, generator=gen, dtype=torch.float64) * 6
    u0 = torch.randn(256, 48, generator=gen, dtype=torch.float64) * 60
    w = torch.randn(256, 48, generator=gen, dtype=torch.float64)
    gd, ud = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    (_reference(gd, ud) * w).sum().backward()
    for dtype, rel in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):  # of the largest grad
        g, u = (x.to(dtype).requires_grad_() for x in (g0, u0))
        out = situ_glu(g, u)
        assert type(out.grad_fn).__name__ == "_SituCPUBackward"
        (out.float() * w.float()).sum().backward()
        assert g.grad.dtype == u.grad.dtype == dtype
        for mine, ref in ((g.grad, gd.grad), (u.grad, ud.grad)):  # measured: 0.43e-6, 0.22e-6
            assert ref.abs().max() > 10
            err = (mine.double() - ref).abs().max().item()
            assert err <= rel * ref.abs().max().item(), (dtype, err)

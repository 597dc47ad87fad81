"""KDA layer glue (gates, short conv) and Gated MLA against direct float64 formulas."""

import math

import torch
import torch.nn.functional as F

from model.ops.kda import kda_gate
from model.packing import Packing
from tests.helpers.tiny import tiny_model


def test_lower_bound_gate_range_and_softplus_gate():
    torch.manual_seed(0)
    f = torch.randn(2, 5, 3, 4, dtype=torch.float64) * 2
    A_log, dt = 0.3 * torch.randn(3, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    g = kda_gate(f, A_log, dt, -5.0)
    assert (g > -5).all() and (g < 0).all() and g.min() < -4.5
    x = f + dt.view(3, 4)
    torch.testing.assert_close(g, -5 * torch.sigmoid(A_log.exp().view(3, 1) * x))
    g2 = kda_gate(f, A_log, dt, None)
    torch.testing.assert_close(g2, -A_log.exp().view(3, 1) * F.softplus(x))
    assert g2.min() < -5  # unbounded


def test_gate_init_matches_fla():
    model = tiny_model()
    kda = model.layers["1"].self_attn
    assert torch.equal(kda.A_log, torch.zeros_like(kda.A_log))  # lower-bound gate: exp(A)=1
    dt = F.softplus(kda.dt_bias)
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
    soft = tiny_model(gate_lower_bound=None).layers["1"].self_attn
    assert (soft.A_log.exp() >= 1 - 1e-6).all() and (soft.A_log.exp() <= 16 + 1e-4).all()


def test_short_conv_matches_conv1d():
    conv = tiny_model().layers["1"].self_attn.k_conv1d
    x = torch.randn(2, 10, conv.weight.shape[0])
    pos = Packing(2, 10, x.device).pos_in_doc
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight,
                          groups=x.shape[-1]).transpose(1, 2))
    torch.testing.assert_close(conv(x, pos), ref)


def test_short_conv_cpu_path_matches_token_loop_with_short_documents():
    """The CPU path (oneDNN convolution, then the cross-document taps removed row by row) in
    fp32 and bf16 against a float64 loop over tokens and taps: values and both gradients, with
    documents of 1 and 2 tokens (taps of neighbouring starts reaching the same source rows)."""
    from model.ops.short_conv import _use_cpu_conv, short_conv_silu

    assert _use_cpu_conv(torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(3)
    lengths = [[1, 2, 1, 5, 3], [7, 1, 4]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    B, T, C, K = 2, 12, 6, 4
    x64 = torch.randn(B, T, C, dtype=torch.float64, generator=g)
    w64 = torch.randn(C, K, dtype=torch.float64, generator=g)
    dy = torch.randn(B, T, C, dtype=torch.float64, generator=g)

    def oracle(x, w):
        y = torch.zeros_like(x)
        for b in range(B):
            for t in range(T):
                for s in range(min(K, int(pos[b, t]) + 1)):
                    y[b, t] = y[b, t] + w[:, K - 1 - s] * x[b, t - s]
        return F.silu(y)

    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref = oracle(xr, wr)
    dx_ref, dw_ref = torch.autograd.grad(ref, (xr, wr), dy)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        x = x64.to(dtype).requires_grad_()
        w = w64.float().requires_grad_()
        y = short_conv_silu(x, w, pos)
        dx, dw = torch.autograd.grad(y, (x, w), dy.to(dtype))
        scale = {"y": ref.abs().max(), "dx": dx_ref.abs().max(), "dw": dw_ref.abs().max()}
        for name, got, want in (("y", y, ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
            err = ((got.double() - want).abs().max() / scale[name]).item()
            assert err < tol, (dtype, name, err)


def test_gated_mla_matches_direct_formula():
    model = tiny_model().double()
    mla = model.layers["3"].self_attn
    cfg = model.config
    B, T, H = 2, 7, cfg.num_attention_heads
    x = torch.randn(B, T, cfg.hidden_size, dtype=torch.float64)
    got = mla(x, Packing(B, T, x.device))

    def rms(v, w, eps):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w

    q = (rms(x @ mla.q_a_proj.weight.T, mla.q_a_layernorm.weight, 1e-6)
         @ mla.q_b_proj.weight.T).view(B, T, H, 24)
    ckv = x @ mla.kv_a_proj_with_mqa.weight.T
    c, kr = ckv[..., :32], ckv[..., 32:]
    kv = (rms(c, mla.kv_a_layernorm.weight, 1e-6) @ mla.kv_b_proj.weight.T).view(B, T, H, 32)
    kc, v = kv[..., :16], kv[..., 16:]
    out = torch.zeros(B, T, H, 16, dtype=torch.float64)
    for h in range(H):
        k = torch.cat([kc[:, :, h], kr], -1)  # the same k_R for every head
        s = q[:, :, h] @ k.transpose(1, 2) / math.sqrt(24)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out[:, :, h] = torch.softmax(s, -1) @ v[:, :, h]
    gate = torch.sigmoid(x @ mla.g_proj.weight.T)
    ref = (out.reshape(B, T, -1) * gate) @ mla.o_proj.weight.T
    torch.testing.assert_close(got, ref)


def test_short_conv_custom_op_gradcheck_with_document_resets():
    """k3::short_conv itself (CUDA and fake traces run it; off CUDA its backward is the
    written-out formula) against finite differences, documents resetting inside the row."""
    from model.ops.short_conv import _conv_op

    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0], [3, 4, 5, 6, 0, 0, 1, 2, 3]])
    assert torch.autograd.gradcheck(lambda a, b: _conv_op(a, b, pos), (x, w))

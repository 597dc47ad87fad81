import pytest
import torch
from torch.utils.checkpoint import checkpoint

from model.dispatch import LocalDispatcher
from model.moe import LatentMoE
from model.ops.grouped_gemm import _padded_bmm, grouped_mm
from model.ops.situ import situ_glu
from tests.helpers.tiny import debug_config


def _moe(**over):
    cfg = debug_config(**over)
    moe = LatentMoE(cfg)
    g = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        with torch.no_grad():
            p.normal_(0, 0.2, generator=g)
    moe.gate.e_score_correction_bias.zero_()
    moe.gate.qb_counts.zero_()
    moe.gate.expert_load.zero_()
    return cfg, moe


def _per_token_reference(moe, cfg, x):
    """Loop over tokens and their chosen experts, float64 (the oracle)."""
    moe = moe.double()
    xs = x.double().reshape(-1, x.shape[-1])
    r = moe.gate
    out = torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        s = torch.sigmoid(r.weight @ xs[t])
        biased = s + r.e_score_correction_bias.double()
        chosen = torch.topk(biased, cfg.num_experts_per_token).indices
        w = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor
        xl = moe.routed_expert_down_proj.weight @ xs[t]
        u = torch.zeros_like(xl)
        for j, e in enumerate(chosen.tolist()):
            E = moe.experts
            h = situ_glu(E.w1[e] @ xl, E.w3[e] @ xl)
            u = u + w[j] * (E.w2[e] @ h)
        u = u / torch.sqrt((u * u).mean() + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
        y = moe.routed_expert_up_proj.weight @ u
        sh = moe.shared_experts
        hs = situ_glu(sh.gate_proj.weight @ xs[t], sh.up_proj.weight @ xs[t])
        y = y + sh.down_proj.weight @ hs
        out[t] = y
    return out.view(x.shape)


@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_grouped_moe_equals_per_token_reference(scaling):
    cfg, moe = _moe(routed_scaling_factor=scaling)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.3)
    x = torch.randn(2, 9, cfg.hidden_size)
    moe.eval()
    got = moe(x)
    ref = _per_token_reference(moe, cfg, x)
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)


def test_bias_only_selects_and_weights_renormalise():
    cfg, moe = _moe(routed_scaling_factor=2.0)
    x = torch.randn(16, cfg.hidden_size)
    idx0, w0 = moe.gate(x)
    torch.testing.assert_close(w0.sum(-1), torch.full((16,), 2.0))
    with torch.no_grad():  # a huge bias on expert 3 forces its selection...
        moe.gate.e_score_correction_bias[3] = 10.0
    idx1, w1 = moe.gate(x)
    assert (idx1 == 3).any(-1).all()
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    expected = scores.gather(-1, idx1)
    torch.testing.assert_close(w1, expected / expected.sum(-1, keepdim=True) * 2.0)  # ...not weight
    assert moe.gate.weight.dtype == torch.float32 and w1.dtype == torch.float32


def test_router_bias_gets_no_gradient_and_stats_record_once_under_checkpoint():
    cfg, moe = _moe()
    moe.train()
    x = torch.randn(2, 8, cfg.hidden_size, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    counts = moe.gate.qb_counts
    assert counts.sum(1).tolist() == [16] * cfg.num_experts  # once, not twice (recompute)
    assert moe.gate.expert_load.sum().item() == 16 * cfg.num_experts_per_token
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    moe.gate.apply_quantile_balancing()
    assert counts.sum() == 0
    assert abs(moe.gate.e_score_correction_bias.mean().item()) < 1e-6
    assert moe.gate.e_score_correction_bias.abs().sum() > 0


def test_no_stats_in_eval():
    cfg, moe = _moe()
    moe.eval()
    moe(torch.randn(1, 4, cfg.hidden_size))
    assert moe.gate.qb_counts.sum() == 0


def test_grouped_mm_backends_agree_with_zero_groups():
    x = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(5, 6, 8, requires_grad=True)
    sizes = torch.tensor([0, 7, 0, 13, 0])
    y1 = grouped_mm(x, w, sizes)
    y2 = _padded_bmm(x, w, sizes)
    ref = torch.cat([x[:7] @ w[1].T, x[7:] @ w[3].T])
    torch.testing.assert_close(y1, ref)
    torch.testing.assert_close(y2, ref)
    (g1,) = torch.autograd.grad(y1.sum(), w)  # stride-0 incoming gradient (trap 14)
    (g2,) = torch.autograd.grad(y2.sum(), w)
    torch.testing.assert_close(g1, g2)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, sizes),
                                    (x.double().detach().requires_grad_(),
                                     w.double().detach().requires_grad_()))


def test_local_dispatcher_roundtrip_and_all_to_one_expert():
    d = LocalDispatcher(4)
    x = torch.randn(6, 3)
    idx = torch.tensor([[2, 0]] * 6)  # every token on experts 2 and 0
    w = torch.rand(6, 2)
    xg, sizes, h = d.dispatch(x, idx, w)
    assert sizes.tolist() == [6, 0, 6, 0]
    torch.testing.assert_close(xg[:6], x)
    out = d.combine(xg * 2, h)  # "expert" doubles its input
    torch.testing.assert_close(out, 2 * x * w.sum(1, keepdim=True))


def test_combine_custom_op_gradcheck():
    """k3::moe_combine itself (CUDA and fake traces run it; off CUDA its backward is written
    out) against finite differences, and its forward against the reference."""
    from model.ops.combine import _combine_op, inverse_order, weighted_combine_reference

    S, k = 4, 3
    y = torch.randn(S * k, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(S, k, dtype=torch.float64, requires_grad=True)
    order = torch.randperm(S * k)
    inv = inverse_order(order)
    assert torch.autograd.gradcheck(lambda a, b: _combine_op(a, inv, b), (y, w))
    torch.testing.assert_close(_combine_op(y, inv, w), weighted_combine_reference(y, order, w))


@pytest.mark.parametrize("gpu_trace", [False, True])
def test_dispatch_gather_and_combine_reference_against_loops_and_finite_differences(gpu_trace):
    """The dispatcher's grouped rows (`_pair_rows`: an expanded index_select on a CPU run,
    x[order // k] where the GPU path is traced) and the combine's reference: forward against
    a per-row loop, gradients against finite differences (float64)."""
    from model.dispatch import _pair_rows
    from model.ops.backends import force_cuda_backends
    from model.ops.combine import weighted_combine_reference

    S, k, d = 5, 3, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, d, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randn(S * k, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(S, k, dtype=torch.float64, generator=g, requires_grad=True)
    order = torch.argsort(torch.randint(0, 4, (S * k,), generator=g), stable=True)
    with force_cuda_backends(gpu_trace):
        rows = _pair_rows(x, order, k)
        for r in range(S * k):  # row r is token order[r] // k
            torch.testing.assert_close(rows[r], x[int(order[r]) // k])
        combined = weighted_combine_reference(y, order, w)
        for s in range(S):  # out[s] = sum_j w[s, j] y[row holding pair (s, j)]
            expect = sum(w[s, j] * y[int((order == s * k + j).nonzero())] for j in range(k))
            torch.testing.assert_close(combined[s], expect)
        assert torch.autograd.gradcheck(lambda a: _pair_rows(a, order, k), (x,))
        assert torch.autograd.gradcheck(lambda a, b: weighted_combine_reference(a, order, b),
                                        (y, w))

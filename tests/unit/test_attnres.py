import math

import pytest
import torch

from model.attnres import mix_weights
from model.ops.attnres import attnres_mix, attnres_mix_reference
from tests.helpers.tiny import debug_config, tiny_model


def _oracle(sources, query, eps=1e-5):
    """Per-token loop over sources in float64 (the §3.3 formula written out)."""
    N = sources.shape[0]
    flat = sources.double().reshape(N, -1, sources.shape[-1])
    q = query.double()
    out = torch.zeros(flat.shape[1:], dtype=torch.float64)
    for t in range(flat.shape[1]):
        logits = []
        for n in range(N):
            v = flat[n, t]
            logits.append(float((v / math.sqrt(float((v * v).mean()) + eps) * q).sum()))
        m = max(logits)
        w = [math.exp(x - m) for x in logits]
        z = sum(w)
        out[t] = sum(w[n] / z * flat[n, t] for n in range(N))
    return out.reshape(sources.shape[1:])


def _op(src, norm_weight, query, eps=1e-5):
    """The model's op on sources [N, ...] (snapshots = src[:-1], prefix = src[-1])."""
    return attnres_mix(src[:-1], src[-1], norm_weight, query, eps)


def test_reference_matches_oracle():
    src = torch.randn(5, 2, 3, 16) * torch.tensor([1.0, 10, 0.1, 3, 1])[:, None, None, None]
    q = torch.randn(16)
    torch.testing.assert_close(attnres_mix_reference(src, q).double(), _oracle(src, q),
                               rtol=1e-5, atol=1e-5)
    assert attnres_mix_reference(src.bfloat16(), q).dtype == torch.bfloat16


@pytest.mark.parametrize("n", [1, 4, 8])
def test_op_matches_oracle_and_keeps_dtype(n):
    src = torch.randn(n + 1, 2, 3, 16) * torch.logspace(-1, 1, n + 1)[:, None, None, None]
    w, q = torch.rand(16) + 0.5, torch.randn(16)
    torch.testing.assert_close(_op(src, w, q).double(), _oracle(src, w * q), rtol=1e-5,
                               atol=1e-5)
    assert _op(src.bfloat16(), w, q).dtype == torch.bfloat16


def test_no_snapshots_returns_the_prefix():
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    out = attnres_mix(x.new_zeros(0, 2, 3, 8), x, torch.ones(8, dtype=torch.float64),
                      torch.randn(8, dtype=torch.float64))
    torch.testing.assert_close(out, x)


def test_zero_query_is_uniform_average():
    src = torch.randn(4, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(attnres_mix_reference(src, torch.zeros(8)), src.mean(0))
    torch.testing.assert_close(_op(src, torch.ones(8), torch.zeros(8)), src.mean(0))


def test_gradcheck():
    src = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attnres_mix_reference, (src, q))
    # the op's hand-written backward, against finite differences of its forward
    blocks = torch.randn(3, 2, 5, 7, dtype=torch.float64, requires_grad=True)
    prefix = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(7, dtype=torch.float64) + 0.5).requires_grad_()
    q = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attnres_mix, (blocks, prefix, w, q))


def test_op_gradients_equal_the_reference_in_float32():
    torch.manual_seed(0)
    src = torch.randn(4, 2, 6, 32) * torch.tensor([1.0, 10, 0.1, 3])[:, None, None, None]
    w, q = torch.rand(32) + 0.5, torch.randn(32) * 0.3
    leaves = [src, w, q]
    leaves = [t.clone().requires_grad_() for t in leaves]
    g = torch.randn(2, 6, 32)
    got = torch.autograd.grad(_op(*leaves), leaves, g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    s, rw, rq = ref_leaves
    ref = torch.autograd.grad(attnres_mix_reference(s, rw * rq), ref_leaves, g.double())
    # w's and q's gradients sum 48 terms of up to ~30 that cancel: float32's error is relative
    # to the gradient's scale, not to each element (an unseeded run once gave 5.6e-5 elementwise)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def _block_counts(cfg, T=4):
    """Run a model and record how many sources each mix sees."""
    import model.decoder as dec

    seen = []
    orig = dec.mix

    def spy(prefix, blocks, *a):
        seen.append(blocks.shape[0] + 1)
        return orig(prefix, blocks, *a)

    dec.mix = spy
    try:
        model = tiny_model(**{k: getattr(cfg, k) for k in (
            "num_hidden_layers", "full_attn_layers", "attn_res_block_size")})
        with torch.no_grad():
            model.hidden_states(torch.randint(0, 100, (1, T)))
    finally:
        dec.mix = orig
    return seen


def test_k3_schedule_has_8_snapshots_and_9_final_sources():
    cfg = debug_config(num_hidden_layers=93, attn_res_block_size=12,
                       full_attn_layers=[*range(4, 93, 4), 93])
    assert cfg.attn_res_snapshot_layers == [0, 12, 24, 36, 48, 60, 72, 84]
    seen = _block_counts(cfg)
    # layer 0: no attention-side mix; then one attention mix (layers >= 1) and one MLP mix per
    # layer, and the final output mix last
    assert len(seen) == 93 + 92 + 1
    assert seen[-1] == 9
    assert seen[0] == 2  # layer 0's MLP mix: embedding snapshot + its attention output
    assert max(seen) == 9


def test_every_attnres_parameter_gets_a_gradient():
    model = tiny_model()
    names = [n for n, _ in model.named_parameters() if "_res_" in n]
    assert len(names) == 2 * 2 * model.config.num_hidden_layers + 2
    # K3 ships layer 0's attention-side pair, but layer 0 has nothing to mix (its input is the
    # embedding), so those two stay unused by design
    unused = {"layers.0.self_attention_res_norm.weight", "layers.0.self_attention_res_proj.weight"}
    names = [n for n in names if n not in unused]
    x = torch.randint(0, 512, (2, 32))
    s, n = model.loss(x, torch.roll(x, -1, 1))
    s.backward()
    params = dict(model.named_parameters())
    # zero pseudo-queries: the projections already get gradients at step 0
    assert all(params[n].grad.abs().sum() > 0 for n in names if "_res_proj" in n)
    # once the queries move, the norm weights get gradients too
    model.zero_grad()
    with torch.no_grad():
        for n in names:
            if "_res_proj" in n:
                params[n].normal_(0, 0.1)
    s, n = model.loss(x, torch.roll(x, -1, 1))
    s.backward()
    missing = [n for n in names if params[n].grad is None or params[n].grad.abs().sum() == 0]
    assert not missing


def test_depth_weights_sum_to_one():
    model = tiny_model()
    layer = model.layers["4"]
    prefix, blocks = torch.randn(1, 3, 64), torch.randn(2, 1, 3, 64)
    w = mix_weights(prefix, blocks, layer.mlp_res_norm, layer.mlp_res_proj, 1e-5)
    torch.testing.assert_close(w.sum(0), torch.ones(1, 3))

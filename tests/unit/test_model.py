import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.build import build_model, materialize
from model.config import ConfigError, load_model_config, preset_names
from model.init import cast_model, keeps_fp32
from model.loss import chunked_cross_entropy
from tests.helpers.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_inspect_k3_figures():
    out = subprocess.run([sys.executable, "-m", "model.inspect", "k3"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert round(info["total_params"] / 1e12, 2) == 2.78
    assert round(info["active_params"] / 1e9, 1) == 104.2
    assert info["n_layers"] == 93
    mla = [i + 1 for i, t in enumerate(info["layer_types"]) if t == "mla"]
    assert mla == [*range(4, 93, 4), 93]
    assert info["layer_types"].count("kda") == 69
    assert info["token_mixer_params"] == {"kda": 443_740_384, "mla": 232_196_096}
    assert info["attn_res_final_sources"] == 9


def test_inspect_bad_preset_is_one_line_error():
    r = subprocess.run([sys.executable, "-m", "model.inspect", "nope"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "debug" in r.stderr


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds_on_meta(name):
    """(The build time is reported by `python -m model.inspect`, not asserted here.)"""
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 0


def test_meta_materialisation_gives_identical_weights():
    direct = build_model("debug", seed=7)
    late = materialize(build_model("debug", device="meta"), "cpu", seed=7)
    sd1, sd2 = direct.state_dict(), late.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    other = build_model("debug", seed=8)
    assert not torch.equal(other.lm_head.weight, direct.lm_head.weight)
    assert direct.layers["0"].self_attention_res_proj.weight.abs().sum() == 0
    assert "layers.1.block_sparse_moe.gate.e_score_correction_bias" in sd1


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        load_model_config("debug", num_experts_per_token=8)
    with pytest.raises(ConfigError, match="full_attn_layers"):
        load_model_config("debug", full_attn_layers=[9])
    with pytest.raises(ConfigError, match="unknown model config field"):
        load_model_config("debug", hiden_size=3)


def test_cast_keeps_k3_fp32_parameters():
    model = cast_model(tiny_model(), torch.bfloat16)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept == {n for n, _ in model.named_parameters() if keeps_fp32(n)}
    assert any(n.endswith("A_log") for n in kept) and any("q_conv1d" in n for n in kept)
    assert model.layers["1"].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    x = torch.randint(0, 512, (2, 32))
    s, n = model.loss(x, x)
    assert torch.isfinite(s)


@pytest.mark.parametrize("grads_in_forward", [True, False])
def test_chunked_loss_equals_full_cross_entropy(grads_in_forward):
    """float64 against F.cross_entropy: the loss sum and, for an upstream gradient of 0.37 (the
    trainer's 1 / tokens), both gradients, whether they are formed in forward or backward."""
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 40, (50,))
    y[::7] = -100
    s, n = chunked_cross_entropy(h, w, y, chunk_tokens=8, grads_in_forward=grads_in_forward)
    ref = F.cross_entropy(h @ w.T, y, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(s, ref)
    assert n.item() == (y != -100).sum().item()
    g1 = torch.autograd.grad(s * 0.37, (h, w))
    g2 = torch.autograd.grad(ref * 0.37, (h, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    only_h = torch.autograd.grad(chunked_cross_entropy(h, w.detach(), y, 8, grads_in_forward)[0],
                                 h)[0]  # the head frozen: d hidden alone
    torch.testing.assert_close(only_h, g2[0] / 0.37)


def test_debug_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = tiny_model()
    x = torch.randint(0, 512, (2, 64))
    y = torch.roll(x, -1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        s, n = model.loss(x, y)
        loss = s / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.apply_quantile_balancing()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses[::5]


@pytest.mark.parametrize("grads_in_forward", [True, False])
def test_chunked_loss_backward_gemms_run_in_the_activation_dtype(grads_in_forward):
    """bf16 activations: every head GEMM takes bf16 operands (no per-chunk fp32 copy of the
    head weight), the logits stay fp32, and the result matches an fp64 oracle to bf16 rounding.
    Gradients formed in forward: 3 chunks x (logits, d hidden, d head) there and no GEMM in
    backward; else 3 logit GEMMs forward and 3 x 3 backward (the logits again). Without
    gradients (evaluation), the logit GEMMs alone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.append((args[-2].dtype, args[-1].dtype, tuple(args[-1].shape)))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    h64 = torch.randn(48, 32, dtype=torch.float64, generator=g)
    w64 = torch.randn(96, 32, dtype=torch.float64, generator=g) * 0.3
    y = torch.randint(0, 96, (48,), generator=g)
    h = h64.to(torch.bfloat16).requires_grad_()
    w = w64.to(torch.bfloat16).requires_grad_()
    with MatmulDtypes() as fwd:
        s, _ = chunked_cross_entropy(h, w, y, chunk_tokens=16, grads_in_forward=grads_in_forward)
    with MatmulDtypes() as bwd:
        dh, dw = torch.autograd.grad(s, (h, w))
    with torch.no_grad(), MatmulDtypes() as evaluation:
        s_eval, _ = chunked_cross_entropy(h, w, y, 16, grads_in_forward)
    assert s.dtype == torch.float32 and torch.equal(s_eval, s.detach())
    assert (len(fwd.seen), len(bwd.seen)) == ((9, 0) if grads_in_forward else (3, 9))
    assert len(evaluation.seen) == 3
    assert all(a == b == torch.bfloat16 for a, b, _ in fwd.seen + bwd.seen), fwd.seen + bwd.seen
    ref_h, ref_w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_h @ ref_w.T, y, reduction="sum")
    torch.testing.assert_close(s.double(), ref, rtol=1e-3, atol=0)
    for got, want in zip((dh, dw), torch.autograd.grad(ref, (ref_h, ref_w))):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).norm() / want.norm()) < 1e-2


def test_head_gradient_accumulates_inside_the_gemm_on_cuda():
    """CUDA path (forced, fake tensors): chunks after the first add their head gradient into the
    fp32 accumulator inside the GEMM (`addmm(out_dtype=fp32, out=dw)`), not as a separate add."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.ops.backends import force_cuda_backends

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with force_cuda_backends(), FakeTensorMode():
        h = torch.empty(48, 32, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(96, 32, dtype=torch.bfloat16, requires_grad=True)
        y = torch.zeros(48, dtype=torch.long)
        with Ops() as ops:
            s, _ = chunked_cross_entropy(h, w, y, chunk_tokens=16)
        assert ops.seen.count("aten.addmm.dtype_out") == 2  # chunks 2 and 3
        assert ops.seen.count("aten.mm.dtype") == 3 + 3 + 1  # logits, d hidden; d head once
        assert "aten.add_.Tensor" not in ops.seen
        dh, dw = torch.autograd.grad(s, (h, w))
        assert dh.dtype == dw.dtype == torch.bfloat16 and dw.shape == w.shape

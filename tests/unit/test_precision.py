"""apply_mxfp8 converts exactly the GEMMs K3 would quantise, and the model still trains."""

import torch

from model.ops.mx_linear import mx_grouped_mm
from model.precision import MXLinear, apply_mxfp8
from tests.helpers.tiny import tiny_model


def _mx_modules(model):
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, MXLinear):
            out.add(name)
        gemm = getattr(m, "gemm", None)
        if gemm is not None and getattr(gemm, "func", None) is mx_grouped_mm:
            out.add(name)
    return out


def test_default_targets_are_experts_shared_and_dense_mlp():
    model = tiny_model()
    converted = set(apply_mxfp8(model))
    assert converted == _mx_modules(model)
    L = model.config.num_hidden_layers
    expected = {"layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"}
    for i in range(1, L):
        expected.add(f"layers.{i}.block_sparse_moe.experts")
        for p in ("gate_proj", "up_proj", "down_proj"):
            expected.add(f"layers.{i}.block_sparse_moe.shared_experts.{p}")
    assert converted == expected


def test_attention_target_and_never_router_norms_gates_head():
    model = tiny_model()
    converted = set(apply_mxfp8(model, ["attention"]))
    expected = set()
    for i, t in enumerate(model.config.layer_types):
        names = (("q_proj", "k_proj", "v_proj", "g_proj", "o_proj") if t == "kda" else
                 ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"))
        expected |= {f"layers.{i}.self_attn.{n}" for n in names}
    assert converted == expected == _mx_modules(model)  # no f_a/f_b/b_proj (KDA gates, beta)
    everything = set(apply_mxfp8(model, ["routed_experts", "shared_experts", "dense_mlp"]))
    for name in _mx_modules(model):  # router, norms, AttnRes, latent projections, head: never
        assert not name.endswith((".gate", "_res_proj", "norm", "lm_head", "embed_tokens",
                                  "routed_expert_down_proj", "routed_expert_up_proj")), name
    assert everything


def test_mxfp8_model_is_close_to_fp32_and_trains():
    torch.manual_seed(0)
    ref = tiny_model()
    mx = tiny_model()
    apply_mxfp8(mx, ["routed_experts", "shared_experts", "dense_mlp", "attention"])
    x = torch.randint(0, 512, (2, 32))
    y = torch.roll(x, -1, 1)
    s_ref, n = ref.loss(x, y)
    s_mx, _ = mx.loss(x, y)
    assert s_mx != s_ref  # quantisation is really applied
    assert abs(s_mx.item() - s_ref.item()) / s_ref.item() < 0.01
    (s_mx / n).backward()
    grads = [p.grad for p in mx.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert set(mx.state_dict()) == set(ref.state_dict())  # names and checkpoints unchanged

"""Per-Head Muon (`train.optim.muon`): the orthogonalisation by its SVD, the update against
torch.optim.Muon, per-head blocks against single-matrix updates, the Muon / AdamW split, and
the AdamW side untouched by Muon."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from model.build import build_model
from model.config import load_model_config
from train.optim.muon import Blocks, MuonAdamW, muon_blocks, newton_schulz, rms_matched_lr


def conditioned(n: int, r: int, c: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """[n, r, c] float64 matrices U diag(s) V^T with singular values in [0.05, 1]."""
    g = torch.Generator().manual_seed(seed)
    k = min(r, c)
    U = torch.linalg.qr(torch.randn(n, r, k, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, c, k, generator=g, dtype=torch.float64))[0]
    s = 0.05 + 0.95 * torch.rand(n, k, generator=g, dtype=torch.float64)
    return U @ torch.diag_embed(s) @ V.mT, U, V


@pytest.mark.parametrize("shape", [(3, 16, 40), (2, 40, 16), (1, 24, 24)])
def test_newton_schulz_orthogonalises_in_the_quintic_band(shape):
    """U^T NS(X) V is diagonal (same singular vectors) with entries in the band the quintic
    iteration (3.4445, -4.7750, 2.0315) reaches in 5 steps, for wide, tall and square blocks."""
    x, U, V = conditioned(*shape)
    o = newton_schulz(x)
    core = U.mT @ o @ V  # [n, k, k]
    diag = torch.diagonal(core, dim1=-2, dim2=-1)
    off = core - torch.diag_embed(diag)
    assert off.abs().max() < 1e-10
    assert diag.min() > 0.6 and diag.max() < 1.25
    # the spectrum collapsed: the input spanned [0.05, 1] (x20), the output spans < x2.1
    assert float(diag.max() / diag.min()) < 2.1
    bf16 = newton_schulz(x.float(), dtype=torch.bfloat16).double()  # CUDA's precision
    assert (bf16 - o).norm() / o.norm() < 2e-2
    fp32 = newton_schulz(x.float()).double()  # CPU's
    assert (fp32 - o).norm() / o.norm() < 1e-5


def test_one_matrix_matches_torch_muon(monkeypatch):
    """A whole matrix: three steps of MuonAdamW equal torch.optim.Muon with
    adjust_lr_fn="match_rms_adamw" (both iterating in bf16, CUDA's precision: equal to bf16
    rounding of the batched vs 2-D GEMMs)."""
    import train.optim.muon as muon_mod

    monkeypatch.setattr(muon_mod, "ns_dtype", lambda x: torch.bfloat16)
    torch.manual_seed(0)
    ours_m, ref_m = nn.Linear(48, 32, bias=False), nn.Linear(48, 32, bias=False)
    ref_m.load_state_dict(ours_m.state_dict())
    ours = MuonAdamW(ours_m, lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon(ref_m.parameters(), lr=0.02, weight_decay=0.1,
                           adjust_lr_fn="match_rms_adamw")
    w0 = ours_m.weight.detach().clone()
    for _ in range(3):
        g = torch.randn(32, 48)
        ours_m.weight.grad, ref_m.weight.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    moved = (ref_m.weight - w0).norm()
    assert moved > 0.05
    assert (ours_m.weight - ref_m.weight).norm() / moved < 5e-3


def test_per_head_blocks_are_single_matrix_updates():
    """KDA's q projection: each head's rows get the update of that block alone (lr scaled by
    the block's shape), which differs from the whole-matrix update."""
    model = build_model("debug", seed=0).double()
    kda = next(m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    H, D = kda.num_heads, kda.head_dim
    W = kda.q_proj.weight
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)
    W.grad = torch.randn_like(W)
    w0 = W.detach().clone()
    lr, mu = 0.01, 0.95
    opt = MuonAdamW(model, lr=lr, weight_decay=0.0, momentum=mu)
    opt.step()
    delta = (W.detach() - w0).view(H, D, -1)
    # first step: buf = (1 - mu) g; nesterov update = lerp(g, buf, mu)
    update = W.grad.lerp((1 - mu) * W.grad, mu).view(H, D, -1)
    for h in range(H):
        want = -rms_matched_lr(lr, D, W.shape[1]) * newton_schulz(update[h:h + 1])[0]
        assert torch.allclose(delta[h], want, atol=1e-12), h
    whole = -rms_matched_lr(lr, H * D, W.shape[1]) * newton_schulz(update.reshape(1, H * D, -1))
    assert (whole.view(H, D, -1) - delta).norm() > 0.1 * delta.norm()


def test_adamw_side_is_plain_adamw():
    """The AdamW parameters move exactly as torch.optim.AdamW moves them alone."""
    torch.manual_seed(2)
    model = build_model("debug", seed=0)
    twin = build_model("debug", seed=0)
    opt = MuonAdamW(model, lr=3e-3, weight_decay=0.1)
    blocks = muon_blocks(model)
    adamw_names = [n for n, p in model.named_parameters() if n not in blocks and p.requires_grad]
    from train.optim.build import no_weight_decay
    tp = dict(twin.named_parameters())
    ref = torch.optim.AdamW(
        [{"params": [tp[n] for n in adamw_names if not no_weight_decay(n, tp[n])],
          "weight_decay": 0.1},
         {"params": [tp[n] for n in adamw_names if no_weight_decay(n, tp[n])],
          "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(2):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for n in adamw_names:
        assert torch.equal(dict(model.named_parameters())[n], tp[n]), n
    o = "layers.0.self_attn.o_proj.weight"  # Muon's side moved apart
    assert o in blocks and not torch.equal(dict(model.named_parameters())[o], tp[o])


def test_split_on_the_k3_preset():
    """Which parameters take Muon, and their blocks, on the full K3 shape (meta device)."""
    cfg = load_model_config("k3")
    model = build_model(cfg, device="meta")
    blocks = muon_blocks(model)
    names = dict(model.named_parameters())
    kda = next(i for i, t in enumerate(cfg.layer_types) if t == "kda")
    mla = next(i for i, t in enumerate(cfg.layer_types) if t != "kda")
    pre = f"layers.{kda}.self_attn"
    q = blocks[f"{pre}.q_proj.weight"].views(names[f"{pre}.q_proj.weight"])
    assert [tuple(t.shape) for t in q] == [(cfg.kda_num_heads, cfg.kda_head_dim,
                                           cfg.hidden_size)]
    pre = f"layers.{mla}.self_attn"
    kv = blocks[f"{pre}.kv_b_proj.weight"].views(names[f"{pre}.kv_b_proj.weight"])
    assert [tuple(t.shape) for t in kv] == [
        (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
        (cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank)]
    assert blocks[f"{pre}.kv_a_proj_with_mqa.weight"] == Blocks()
    moe = next(n for n in names if n.endswith("experts.w1"))
    assert blocks[moe].views(names[moe])[0].shape[0] == cfg.num_experts
    adamw = [n for n in names if n not in blocks]
    for n in adamw:
        p = names[n]
        assert (p.ndim < 2 or "embed_tokens" in n or "lm_head" in n or "conv1d" in n
                or n.endswith("_res_proj.weight") or n.endswith(".gate.weight")), n
    assert any(n.endswith(".gate.weight") for n in adamw)  # the router
    assert all(names[n].ndim >= 2 for n in blocks)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(3)
    a, b = build_model("debug", seed=0), build_model("debug", seed=0)
    opt_a = MuonAdamW(a, lr=1e-2, weight_decay=0.1)
    grads = [[torch.randn_like(p) for p in a.parameters()] for _ in range(2)]
    for p, g in zip(a.parameters(), grads[0]):
        p.grad = g.clone()
    opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = MuonAdamW(b, lr=1e-2, weight_decay=0.1)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as a checkpoint would: no aliasing
    for m, opt in ((a, opt_a), (b, opt_b)):
        for p, g in zip(m.parameters(), grads[1]):
            p.grad = g.clone()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


_ROUTES = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from launch.pretrain import load_job
from parallel.dims import ParallelDims
from parallel.parallelize import shard_on_meta
from train.optim.muon import _tile, exchange_plans, muon_blocks
from train.optim.muon_dist import route

out = {}
for argv in json.loads(sys.argv[1]):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    job = load_job(["+cluster=local_cpu", "optim=muon", *argv], 4)
    dims = ParallelDims.from_config(job.parallel, 4)
    model = shard_on_meta(job, dims, dims.build_meshes("cpu"), 0, log=lambda m: None)[0].model
    blocks = muon_blocks(model)
    routes = {}
    for name, p in model.named_parameters():
        if name in blocks:
            r = route(p, _tile(p, blocks[name]))
            routes[name] = [r.kind, r.inner is not None]
    plans = exchange_plans(model)
    out[" ".join(argv)] = {"routes": routes, "groups": len(plans),
                           "bytes": sum(e.exchange_bytes(4) for e in plans)}
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_sharded_routes_gather_no_whole_model():
    """On 4 ranks (a fake process group, the layouts built as training builds them): per-head
    blocks and experts stay where they live; under tp 2 x dp 2 the whole matrices TP splits
    go to owners that join only TP's shards, nothing is gathered over the whole mesh and all
    exchanges of a mesh are one (module docstring of `train.optim.muon_dist`)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    layouts = [["parallel.tp=2", "parallel.dp_shard=2"], ["parallel.dp_shard=4", "parallel.ep=2"],
               ["parallel.tp=4"]]
    res = subprocess.run([sys.executable, "-c", _ROUTES, json.dumps(layouts)],
                         capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])

    def kinds(layout: str, suffix: str) -> set:
        return {tuple(v) for k, v in got[layout]["routes"].items() if k.endswith(suffix)}

    tp_dp = "parallel.tp=2 parallel.dp_shard=2"
    for per_head in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "kv_b_proj.weight",
                     "experts.w1", "experts.w2"):
        assert kinds(tp_dp, per_head) == {("local", False)}, per_head
    for tp_split in ("o_proj.weight", "g_proj.weight", "mlp.down_proj.weight",
                     "shared_experts.up_proj.weight"):
        assert kinds(tp_dp, tp_split) == {("owner", True)}, tp_split
    assert kinds(tp_dp, "f_a_proj.weight") == {("owner", False)}  # tp-replicated
    assert all(k != "gather" for k, _ in got[tp_dp]["routes"].values())
    assert got[tp_dp]["groups"] == 1 and got[tp_dp]["bytes"] > 0
    ep = "parallel.dp_shard=4 parallel.ep=2"  # experts 2-D sharded (edp x ep), whole per rank
    assert kinds(ep, "experts.w3") == {("local", False)}
    assert all(k != "gather" for k, _ in got[ep]["routes"].values())
    tp = "parallel.tp=4"  # TP alone: row-split matrices to owners over tp, column-split gathered
    assert kinds(tp, "o_proj.weight") == {("gather", False)}
    assert kinds(tp, "mlp.gate_proj.weight") == {("owner", False)}
    assert kinds(tp, "q_proj.weight") == {("local", False)}

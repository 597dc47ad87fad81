"""End-to-end MTP (`model.num_nextn_predict_layers=1`) under the real launcher, in the fp64
verification mode: one rank trains and logs `mtp_loss`, its router is Quantile-Balanced like
every other (its row in the load statistics, its bias moved); 2 pipeline stages (the MTP
module on the last, the next-token embeddings carried from the first) and tensor parallel 2
with expert parallel 2 give the same losses, MTP losses, gradient norms and parameters; the step-2
checkpoint resumes bit for bit; the HF export writes the MTP layer as layer num_hidden_layers
in DeepSeek-V3's names and reads back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.runs import (
    assert_parameters_equal,
    metrics,
    pretrain,
    pretrain_concurrently,
    pretrain_many,
)
from train.checkpoint.export_hf import export_hf, load_hf_state_dict, load_model

FP64 = ["model.num_nextn_predict_layers=1", "train.steps=4", "checkpoint.interval=2",
        "cluster.param_dtype=fp64"]
L = 8  # the debug preset's num_hidden_layers: the MTP layer's index


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    run = tmp_path_factory.mktemp("mtp") / "one"
    pretrain(run, *FP64)
    return run


def test_mtp_trains_logs_and_balances_its_router(one):
    got = metrics(one)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert got[-1]["mtp_loss"] < got[0]["mtp_loss"] - 0.2, got
    for m in got:
        assert m["moe_layer_ids"][-1] == L and len(m["expert_load_per_layer"]) == 8
    model, _ = load_model(one / "checkpoints" / "step-00000004")
    bias = model.mtp.layer.block_sparse_moe.gate.e_score_correction_bias
    assert bias.abs().sum() > 0  # moved by Quantile Balancing


LAYOUTS = {  # 2 ranks each
    "pp2": ["parallel.pp=2"],
    # the experts over ep 2 borrow the tp ranks: the MTP layer's MLA split by heads, its
    # experts by ep
    "tp2_ep2": ["parallel.tp=2", "parallel.ep=2"],
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_layouts")
    pretrain_many([(root / name, [*FP64, *extra]) for name, extra in LAYOUTS.items()], nproc=2)
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_layouts_equal_one_rank(one, layouts, name):
    run = layouts[name]
    for r, g in zip(metrics(one), metrics(run), strict=True):
        for key, rtol in (("loss", 1e-9), ("mtp_loss", 1e-9), ("grad_norm", 1e-6)):
            assert abs(g[key] - r[key]) <= rtol * abs(r[key]), (key, r, g)
    names = assert_parameters_equal(one, run, 4)
    assert sum(n.startswith("mtp.") for n in names) > 10


def test_mtp_run_resumes_bit_for_bit_and_exports(one, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(one, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    pretrain_concurrently((resumed, FP64))
    keys = ("step", "loss", "mtp_loss", "grad_norm", "expert_load_per_layer")
    assert [[m[k] for k in keys] for m in metrics(resumed)] == \
        [[m[k] for k in keys] for m in metrics(one)]

    out = export_hf(one / "checkpoints" / "step-00000004", tmp_path / "hf", dtype=torch.float32)
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    P = f"language_model.model.layers.{L}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_b_proj.weight",
                 "block_sparse_moe.experts.0.w1.weight", "input_layernorm.weight"):
        assert P + name in names, name
    model, _ = load_model(one / "checkpoints" / "step-00000004")
    state = {k: v for k, v in model.state_dict().items()
             if not k.endswith(("qb_counts", "expert_load"))}
    back = load_hf_state_dict(out)
    assert list(back) == list(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k

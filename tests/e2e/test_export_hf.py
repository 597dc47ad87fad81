"""End-to-end: a real 2-step checkpoint exported to Kimi K3 HF safetensors by
`train.checkpoint.export_hf`.

One run (1 rank, debug model) is shared. The CLI runs as a subprocess, three at once (fp32 export,
an existing --output, a run without checkpoints) because each pays torch's import; the bf16 export
goes through the Python API. Expected names come from the K3 tensor list (k3-architecture.md §7.1),
not from our modules, and expected values from an independent DCP load into `build_model`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from model.build import build_model
from model.config import ModelConfig
from tests.helpers.runs import ROOT, pretrain
from train.checkpoint.export_hf import export_hf, load_hf_state_dict, model_config_from_hf

P = "language_model.model."
FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "gate.weight",
                 "e_score_correction_bias", "_res_norm.weight", "_res_proj.weight")


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train.checkpoint.export_hf", *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    pretrain(root / "run", "train.steps=2", "checkpoint.interval=2")
    (root / "empty_run").mkdir()
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    procs = {"fp32": cli(root / "run", "--output", root / "fp32", "--dtype", "fp32",
                         "--max-shard-gb", "0.001"),
             "taken": cli(root / "run", "--output", root / "taken"),
             "empty": cli(root / "empty_run", "--output", root / "never")}
    results = {k: (*p.communicate(timeout=180), p.returncode) for k, p in procs.items()}
    ckpt = root / "run" / "checkpoints" / "step-00000002"
    cfg = ModelConfig.from_dict(json.loads((ckpt / "train_state.json").read_text())["model_config"])
    model = build_model(cfg)
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load({"model": state}, checkpoint_id=str(ckpt))
    return {"root": root, "ckpt": ckpt, "cfg": cfg, "state": state, "cli": results}


def expected_names(cfg: ModelConfig) -> set[str]:
    """Every K3 HF tensor name of `cfg`, from the checkpoint-name list of §7.1."""
    names = {f"{P}embed_tokens.weight", f"{P}norm.weight", f"{P}output_attn_res_norm.weight",
             f"{P}output_attn_res_proj.weight", "language_model.lm_head.weight"}
    kda = ["q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj",
           "f_b_proj", "b_proj", "g_proj", "o_norm", "o_proj"]
    mla = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]) + [
        "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"] + (
        ["g_proj"] if cfg.mla_use_output_gate else [])
    moe = ["gate", "routed_expert_down_proj", "routed_expert_up_proj"] + (
        ["routed_expert_norm"] if cfg.latent_moe_use_norm else []) + (
        [f"shared_experts.{p}_proj" for p in ("gate", "up", "down")]
        if cfg.num_shared_experts else []) + [
        f"experts.{e}.{w}" for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")]
    for i in range(cfg.num_hidden_layers):
        layer = f"{P}layers.{i}."
        is_mla = (i + 1) in cfg.full_attn_layers
        mods = [f"self_attn.{m}" for m in (mla if is_mla else kda)]
        if not is_mla:
            names |= {f"{layer}self_attn.A_log", f"{layer}self_attn.dt_bias"}
        if i >= cfg.first_k_dense_replace:
            mods += [f"block_sparse_moe.{m}" for m in moe]
            names.add(f"{layer}block_sparse_moe.gate.e_score_correction_bias")
        else:
            mods += [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        mods += ["input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                 "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"]
        names |= {f"{layer}{m}.weight" for m in mods}
    return names


def read_export(out) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / f), "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            tensors.update({k: sf.get_tensor(k) for k in sf.keys()})
            assert all(index["weight_map"][k] == f for k in sf.keys())
    assert sorted(tensors) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return tensors


def test_fp32_export_equals_checkpoint(run):
    stdout, stderr, rc = run["cli"]["fp32"]
    assert rc == 0, stderr
    out, cfg, state = run["root"] / "fp32", run["cfg"], run["state"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json"], files
    got = read_export(out)
    assert set(got) == expected_names(cfg)
    assert len(got) == 380  # debug preset: pinned so a naming change is seen here
    assert not any("qb_counts" in k or "expert_load" in k for k in got)
    experts = state["layers.1.block_sparse_moe.experts.w2"]
    w2 = got[f"{P}layers.1.block_sparse_moe.experts.7.w2.weight"]
    assert w2.shape == (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size)
    assert torch.equal(w2, experts[7])
    assert torch.equal(got["language_model.lm_head.weight"], state["lm_head.weight"])
    assert torch.equal(got[f"{P}output_attn_res_proj.weight"], state["output_attn_res_proj.weight"])
    for name, t in got.items():
        assert t.dtype == torch.float32, name
    fresh = build_model(cfg).state_dict()  # the export holds trained values, not the init
    assert not torch.equal(state["layers.3.self_attn.q_b_proj.weight"],
                           fresh["layers.3.self_attn.q_b_proj.weight"])
    assert state["layers.1.block_sparse_moe.gate.e_score_correction_bias"].abs().sum() > 0

    back = load_hf_state_dict(out)  # the inverse: our names, experts re-stacked, no QB stats
    ours = {k: v for k, v in state.items() if not k.endswith(("qb_counts", "expert_load"))}
    assert list(back) == list(ours)
    for k, v in ours.items():
        assert torch.equal(back[k], v), k

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k3"
    assert config["text_config"]["model_type"] == "kimi_linear"
    linear = config["text_config"]["linear_attn_config"]
    assert linear["full_attn_layers"] == [4, 8] and linear["kda_layers"] == [1, 2, 3, 5, 6, 7]
    assert linear["num_heads"] == cfg.kda_num_heads and linear["head_dim"] == cfg.kda_head_dim
    assert config["text_config"]["num_experts"] == cfg.num_experts
    assert config["k3train"]["step"] == 2
    assert config["k3train"]["source"] == str(run["ckpt"].resolve())
    assert model_config_from_hf(config) == cfg


def test_bf16_export_keeps_fp32_tensors(run):
    out = export_hf(run["ckpt"], run["root"] / "bf16")  # default dtype: bf16
    got, state = read_export(out), run["state"]
    back = load_hf_state_dict(out)
    fp32 = {k for k, t in got.items() if t.dtype == torch.float32}
    assert fp32 == {k for k in got if k.endswith(FP32_SUFFIXES)}
    assert {k for k, t in got.items() if t.dtype == torch.bfloat16} == set(got) - fp32
    assert any("A_log" in k for k in fp32) and any("correction_bias" in k for k in fp32)
    assert any("conv1d" in k for k in fp32) and any("_res_proj" in k for k in fp32)
    for k, t in back.items():
        assert torch.equal(t, state[k].to(t.dtype)), k
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_refuses_existing_output(run):
    stdout, stderr, rc = run["cli"]["taken"]
    assert rc == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "--overwrite" in stderr, stderr
    taken = run["root"] / "taken"
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert not list(run["root"].glob("*.tmp-*"))


def test_refuses_run_without_checkpoint(run):
    stdout, stderr, rc = run["cli"]["empty"]
    assert rc == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "no complete checkpoint" in stderr, stderr
    assert not (run["root"] / "never").exists()
    assert not list(run["root"].glob("never*"))

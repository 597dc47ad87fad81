"""Continued pretraining from K3's released format (`train.checkpoint.import_hf`, issue #19).

A synthetic checkpoint in K3's release layout (`tests/helpers/k3_release.py`: bf16 text tensors,
MXFP4-packed routed experts dequantised by compressed-tensors, vision tensors, 3 shards, a tiktoken
tokenizer) is imported by the CLI on one process and by 2 ranks under torchrun. The imported model's
logits equal the source model's bit for bit; the two imports hold the same tensors; the launcher
continues the run directory (no `model=` given: the model comes from the checkpoint) on one rank and
in tp 2, pp 2, ep 2 and cp 2 layouts with the same step-1 loss and gradient norm (fp64 verification
mode) and the same parameters after it, and so do tp 2 and pp 2 runs started from the release itself
(`checkpoint.init_from`, no import); export -> import -> export reproduces tensors, index and
config; malformed inputs are one-line errors that leave nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from data.tokenizer import load_tokenizer
from model.build import build_model
from tests.helpers.k3_release import write_release, write_tiktoken
from tests.helpers.runs import (
    FAST,
    ROOT,
    assert_parameters_equal,
    close,
    metrics,
    pretrain,
    pretrain_many,
)
from train.checkpoint.export_hf import export_hf, load_model
from train.checkpoint.import_hf import main as import_main

TRAINING_KNOBS = ["model.kda_chunk_size=32", "model.loss_chunk_tokens=1024"]  # the debug preset's
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "ep2": ["parallel.ep=2"],
           "cp2": ["parallel.cp=2"]}
FROM_RELEASE = ("tp2", "pp2")  # checkpoint.init_from: no import, each rank reads its slices
RUN = ["train.steps=1", "checkpoint.interval=100", "cluster.param_dtype=fp64"]  # verification


def _import_cli(*args, nproc: int = 1) -> subprocess.Popen:
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", "-m"] if nproc > 1 else [sys.executable, "-m"])
    return subprocess.Popen([*head, "train.checkpoint.import_hf", *map(str, args)], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("import")
    source = build_model("debug", seed=3)
    release = write_release(source, root / "release")
    procs = {"one": _import_cli(release, "--output", root / "run", *TRAINING_KNOBS),
             "two": _import_cli(release, "--output", root / "run_2ranks", *TRAINING_KNOBS,
                                nproc=2)}
    done = {k: (*p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
    for k, (_, err, rc) in done.items():
        assert rc == 0, (k, err[-3000:])
    for name in ("one_rank", *LAYOUTS):
        shutil.copytree(root / "run", root / name)
    pretrain(root / "one_rank", *RUN)
    straight = [(root / f"release_{n}", [*RUN, *LAYOUTS[n], f"checkpoint.init_from={release}",
                                         *TRAINING_KNOBS]) for n in FROM_RELEASE]
    pretrain_many([(root / n, [*RUN, *extra]) for n, extra in LAYOUTS.items()], nproc=2)
    # a launch of their own: on torch 2.11, after the cp 2 job in the same processes, the tp 2
    # job's rank 1 aborted in its first forward (alone it passes)
    pretrain_many(straight, nproc=2)
    return {"root": root, "source": source, "release": release, "cli": done}


def _logits(model, ids):
    with torch.no_grad():
        return model.lm_head(model.hidden_states(ids))


def test_imported_model_equals_the_source(runs):
    root, source = runs["root"], runs["source"]
    step0 = root / "run" / "checkpoints" / "step-00000000"
    model, train_state = load_model(step0)
    assert train_state["weights_only"] and (step0 / "checksums.json").is_file()
    mine, theirs = model.state_dict(), source.state_dict()
    assert sorted(mine) == sorted(theirs)
    for k, t in mine.items():
        expected = torch.zeros_like(t) if k.endswith(("qb_counts", "expert_load")) else theirs[k]
        assert torch.equal(t, expected), k
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, ids), _logits(source, ids))
    summary = json.loads((root / "run" / "import.json").read_text())
    assert (summary["mxfp4"], summary["skipped_vision"]) == (7 * 8 * 3, 3)
    assert "vision_config" in summary["skipped_fields"]
    assert load_tokenizer(root / "run" / "tokenizer").vocab_size == 512
    assert "168 MXFP4 dequantised, 3 vision skipped" in runs["cli"]["one"][0]


def test_two_ranks_write_the_same_checkpoint(runs):
    root = runs["root"]
    step0 = root / "run_2ranks" / "checkpoints" / "step-00000000"
    files = [p.name for p in step0.glob("*.distcp")]  # __<rank>_<n>.distcp: one per tensor
    assert {f.split("_")[2] for f in files} == {"0", "1"} and len(files) > 200
    a, _ = load_model(root / "run" / "checkpoints" / "step-00000000")
    b, _ = load_model(step0)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_continue_from_the_import(runs, name):
    root = runs["root"]
    ref, got = metrics(root / "one_rank"), metrics(root / name)
    assert [m["step"] for m in got] == [1] and got[0]["sample_ids"] == ref[0]["sample_ids"]
    assert close(got[0]["loss"], ref[0]["loss"], 1e-9), (got[0]["loss"], ref[0]["loss"])
    assert close(got[0]["grad_norm"], ref[0]["grad_norm"], 1e-6)
    assert len(assert_parameters_equal(root / "one_rank", root / name, 1)) > 50  # after step 1
    assert "initialised from the imported weights" in (root / f"{name}.stdout").read_text()


@pytest.mark.parametrize("name", FROM_RELEASE)
def test_layouts_start_from_the_release_directly(runs, name):
    root = runs["root"]
    ref, got = metrics(root / "one_rank"), metrics(root / f"release_{name}")
    assert got[0]["sample_ids"] == ref[0]["sample_ids"]
    assert close(got[0]["loss"], ref[0]["loss"], 1e-9), (got[0]["loss"], ref[0]["loss"])
    assert close(got[0]["grad_norm"], ref[0]["grad_norm"], 1e-6)
    assert len(assert_parameters_equal(root / "one_rank", root / f"release_{name}", 1)) > 50
    assert "initialised from the release" in (root / f"release_{name}.stdout").read_text()


def test_export_import_export_round_trip(runs, tmp_path):
    root = runs["root"]
    first = export_hf(root / "run" / "checkpoints" / "step-00000000", tmp_path / "e1")
    assert import_main([str(first), "--output", str(tmp_path / "r2"), "--tokenizer", "none"]) == 0
    second = export_hf(tmp_path / "r2" / "checkpoints" / "step-00000000", tmp_path / "e2")
    index = [json.loads((d / "model.safetensors.index.json").read_text()) for d in (first, second)]
    assert index[0] == index[1]
    for f in set(index[0]["weight_map"].values()):
        a, b = load_file(str(first / f)), load_file(str(second / f))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), f
    configs = [json.loads((d / "config.json").read_text()) for d in (first, second)]
    for c in configs:  # provenance: the checkpoint each export came from
        assert c["k3train"].pop("source").endswith("step-00000000")
    assert configs[0] == configs[1]


def _break(release, tmp_path, case):
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    config = json.loads((bad / "config.json").read_text())
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    if case == "missing_shard":
        (bad / "model-00002-of-00003.safetensors").unlink()
    elif case == "wrong_shape":
        f = bad / index["language_model.model.norm.weight"]
        tensors = load_file(str(f))
        tensors["language_model.model.norm.weight"] = torch.ones(65, dtype=torch.bfloat16)
        save_file(tensors, str(f))
    elif case == "quant_format":
        config["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    elif case == "unknown_field":
        config["text_config"]["sliding_window"] = 4096
    elif case == "vocab":
        write_tiktoken(bad, base=300)  # 300 + 256 special ids > the model's 512
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("case, words", [
    ("missing_shard", "model-00002-of-00003.safetensors is missing"),
    ("wrong_shape", "language_model.model.norm.weight has shape [65]"),
    ("quant_format", "'nvfp4-pack-quantized' is not supported"),
    ("unknown_field", "--ignore-field sliding_window"),
    ("vocab", "has 556 ids but the model's vocab_size is 512"),
])
def test_malformed_inputs_are_one_line_errors(runs, tmp_path, capsys, case, words):
    bad = _break(runs["release"], tmp_path, case)
    out = tmp_path / "out"
    assert import_main([str(bad), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("import_hf: error: ") and words in err, err
    assert not out.exists()  # nothing half-written stays


@pytest.mark.parametrize("case, words", [
    ("missing_shard", "model-00002-of-00003.safetensors is missing"),
    ("wrong_shape", "language_model.model.norm.weight has shape [65]"),
    ("unknown_field", "text_config.sliding_window"),
])
def test_a_bad_release_to_start_from_is_one_line(runs, tmp_path, capsys, monkeypatch, case,
                                                 words):
    from launch.pretrain import main as pretrain_main

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher accepted this release and went on to train")

    monkeypatch.setattr("train.distributed.init_distributed", refuse)
    bad = _break(runs["release"], tmp_path, case)
    run_dir = tmp_path / "run"
    argv = ["+cluster=local_cpu", *FAST, f"run.dir={run_dir}", f"checkpoint.init_from={bad}"]
    assert pretrain_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoint.init_from=") \
        and words in err, err
    assert not run_dir.exists()


def test_an_ignored_field_is_accepted_and_logged(runs, tmp_path, capsys):
    bad = _break(runs["release"], tmp_path, "unknown_field")
    args = [str(bad), "--output", str(tmp_path / "out"), "--ignore-field", "sliding_window"]
    assert import_main(args) == 0
    assert "text_config.sliding_window" in capsys.readouterr().out


def test_sample_continues_greedily_like_the_source(runs, capsys):
    from train.checkpoint.sample import main as sample_main

    root, source = runs["root"], runs["source"]
    tok = load_tokenizer(root / "run" / "tokenizer")
    ids = tok.encode("kimi")
    with torch.no_grad():  # the oracle: argmax of the source model's last position, 6 times
        for _ in range(6):
            ids.append(int(_logits(source, torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == tok.eos_id:
                break
    assert sample_main([str(root / "run"), "--prompt", "kimi", "--tokens", "6"]) == 0
    assert capsys.readouterr().out == tok.decode(ids) + "\n"

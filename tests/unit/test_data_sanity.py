"""The validation split of `data.prepare --val-fraction` (whole documents, disjoint, evenly
spaced) and the start-up data summary with its warnings (`train.preflight.describe_data`)."""

from __future__ import annotations

import json

import numpy as np

from data.dataset import PackedTokenDataset
from data.prepare import main as prepare


def _docs(tmp_path, n=40):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc{i:02d} " * 20}) + "\n" for i in range(n)))
    return src


def _texts(folder) -> list[str]:
    ds = PackedTokenDataset(folder, 8)
    toks = ds.tokens(0, ds.total_tokens)
    bounds = [*ds.doc_starts.tolist(), ds.total_tokens]
    return [bytes(toks[a:b].astype(np.uint8)).decode()[:5] for a, b in zip(bounds, bounds[1:])]


def test_val_fraction_holds_out_whole_documents(tmp_path, capsys):
    out = tmp_path / "data"
    assert prepare([str(_docs(tmp_path)), "--output", str(out), "--workers", "1",
                    "--val-fraction", "0.1"]) == 0
    assert "validation split" in capsys.readouterr().out
    train, val = _texts(out), _texts(out / "val")
    assert val == ["doc09", "doc19", "doc29", "doc39"]  # floor((i+1)/10) > floor(i/10)
    assert sorted(train + val) == [f"doc{i:02d}" for i in range(40)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["val"]["num_docs"] == 4 and manifest["num_docs"] == 36


def test_a_fraction_that_holds_out_nothing_is_one_line(tmp_path, capsys):
    out = tmp_path / "data"
    assert prepare([str(_docs(tmp_path, 5)), "--output", str(out), "--workers", "1",
                    "--val-fraction", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--val-fraction" in err[0]
    assert not out.exists()


def test_describe_data_warns_about_a_batch_larger_than_the_corpus(tmp_path):
    from launch.pretrain import load_job
    from train.preflight import build_loader, describe_data

    out = tmp_path / "data"
    assert prepare([str(_docs(tmp_path)), "--output", str(out), "--workers", "1"]) == 0
    job = load_job(["+cluster=local_cpu", f"data.dataset={out}", "data.seq_len=16",
                    "data.global_batch=512", "data.micro_batch=8", "train.steps=3",
                    f"run.dir={tmp_path / 'run'}"], 1)
    loader = build_loader(job, 0, 1)
    lines, warnings = describe_data(job, loader, None)
    assert f"{loader.num_samples} windows of data.seq_len=16" in lines[0]
    assert any("one step reads the whole corpus" in w for w in warnings)
    assert any("data.max_epochs=4" in w for w in warnings)
    job.data.global_batch, job.train.steps = 8, 1
    assert describe_data(job, build_loader(job, 0, 1), None)[1] == []

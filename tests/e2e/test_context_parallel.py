"""Context parallelism (`parallel.cp`) through the real launcher, fp64 verification mode: cp 2 and
cp 4, and cp 2 with tp 2, pp 2, ep 2 and dp_replicate 2, give the same per-step losses, gradient
norms, clipped heads (QK-Clip at tau 2: the Ulysses logit bounds gathered back to every head), MTP
losses (the next-token embeddings of each shard taken from the whole rows), validation losses and
parameters as one rank, on a corpus of short documents (3-60 bytes) so that documents start inside
cp shards, exactly at their edges, and cross them; cp 2's step-2 checkpoint resumes on one rank
with the same losses and parameters."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from data.prepare import prepare
from tests.helpers.runs import assert_parameters_equal, close, metrics, pretrain, pretrain_many

LAYOUTS = {
    "cp2": (["parallel.cp=2"], 2),
    # full activation checkpointing rides along: the recompute repeats the exchanges
    "cp4": (["parallel.cp=4", "parallel.activation_checkpoint=full"], 4),
    "cp2_tp2": (["parallel.cp=2", "parallel.tp=2"], 4),
    "cp2_pp2": (["parallel.cp=2", "parallel.pp=2"], 4),
    # experts over ep 2 inside dp_shard 2 x cp 2 (ep borrows a cp rank)
    "cp2_ep2": (["parallel.cp=2", "parallel.dp_shard=2", "parallel.ep=2"], 4),
    # HSDP: two replicas of a cp 2 group (gradients all-reduced across the replicas)
    "cp2_hsdp2": (["parallel.cp=2", "parallel.dp_replicate=2"], 4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kimi", "state", "shard", "token", "rank"]
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(3000):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 10)))
            f.write(json.dumps({"text": text}) + "\n")
    corpus = prepare([root / "docs.jsonl"], root / "corpus", "byte", workers=1, progress=False,
                     val_fraction=0.05)
    args = ["data=prepared", f"data.dataset={corpus}", "train.steps=3", "checkpoint.interval=2",
            "cluster.param_dtype=fp64", "optim.qk_clip_tau=2.0",
            "model.num_nextn_predict_layers=1", "eval.every=3", "eval.batches=2"]
    out = {n: root / n for n in ("ref", "resumed", *LAYOUTS)}
    pretrain(out["ref"], *args)
    for nproc in (2, 4):
        pretrain_many([(out[n], [*args, *extra]) for n, (extra, w) in LAYOUTS.items()
                       if w == nproc], nproc=nproc)
    shutil.copytree(out["cp2"] / "checkpoints" / "step-00000002",
                    out["resumed"] / "checkpoints" / "step-00000002")
    pretrain(out["resumed"], *args)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_rank(runs, name):
    ref, got = metrics(runs["ref"]), metrics(runs[name])
    assert [m["step"] for m in got] == [1, 2, 3]
    for r, g in zip(ref, got, strict=True):
        assert close(g["loss"], r["loss"], 1e-9), (name, r["step"], g["loss"], r["loss"])
        assert close(g["mtp_loss"], r["mtp_loss"], 1e-9), (name, g["mtp_loss"], r["mtp_loss"])
        assert close(g["grad_norm"], r["grad_norm"], 1e-6), (name, g["grad_norm"])
        assert g["qk_clipped_heads"] == r["qk_clipped_heads"] > 0, (name, g, r)
        assert g["sample_ids"] == r["sample_ids"]
    for key in ("val_loss", "val_mtp_loss"):  # step 3's validation, MTP head included
        assert close(got[-1][key], ref[-1][key], 1e-9), (name, key, got[-1][key], ref[-1][key])
    assert len(assert_parameters_equal(runs["ref"], runs[name], 3)) > 50


def test_cp_checkpoint_resumes_on_one_rank(runs):
    ref, got = metrics(runs["ref"]), metrics(runs["resumed"])
    assert [m["step"] for m in got] == [3]
    for g in got:
        assert close(g["loss"], ref[g["step"] - 1]["loss"], 1e-9), (g, ref[g["step"] - 1])
        assert close(g["val_loss"], ref[g["step"] - 1]["val_loss"], 1e-9), g
    assert len(assert_parameters_equal(runs["ref"], runs["resumed"], 3)) > 50


def test_documents_cross_and_start_inside_shards(runs):
    """The corpus exercises every case of the state passing: over the trained rows (64 tokens,
    cp 4 shards of 16), documents start inside shards and exactly at shard edges, and cross
    edges."""
    from data.dataset import PackedTokenDataset

    ds = PackedTokenDataset(runs["ref"].parent / "corpus", 64)
    inside = at_edge = crossing = 0
    for i in (i for m in metrics(runs["ref"]) for i in m["sample_ids"]):
        doc = ds[i]["doc_ids"]
        starts = [p for p in range(1, 64) if doc[p] != doc[p - 1]]
        inside += sum(p % 16 != 0 for p in starts)
        at_edge += sum(p % 16 == 0 for p in starts)
        crossing += sum(doc[e] == doc[e - 1] for e in (16, 32, 48))
    assert inside > 0 and at_edge > 0 and crossing > 0, (inside, at_edge, crossing)

"""Tensor, sequence and pipeline parallelism through the real launcher on 4 gloo ranks: every
layout trains the debug model to the same per-step losses, gradient norms and parameters as one
rank, the same validation loss, and a checkpoint written under one layout resumes under
another.

The layout runs use `cluster.param_dtype=fp64`. In fp32 a layout's different summation order
moves hidden states by ~1e-7, which can flip a near-tied top-k routing decision; the flipped
expert's Adam update then differs by O(lr) in a few elements (losses stay within 1e-5). In
float64 no tie is that close, so parameters must agree to fp32 round-off. One fp32 run checks
the losses in the production dtype."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.helpers.runs import (
    assert_parameters_equal,
    losses,
    metrics,
    pretrain,
    pretrain_concurrently,
    pretrain_many,
)
from train.config import torch_version

# torch < 2.13 cannot run the zero-bubble schedules (`train.config.zero_bubble_unsupported`):
# there their jobs must be refused in one line instead
ZERO_BUBBLE_RUNS = torch_version() >= (2, 13)
ZERO_BUBBLE_JOBS = ("to_zbv", "InterleavedZeroBubble")

ARGS = ["train.steps=4", "checkpoint.interval=3", "cluster.param_dtype=fp64",
        "eval.every=4", "eval.batches=2"]  # validation loss at step 4, in every layout
IMAGES = "train.log_images_every=4"  # the diagnostic images of the whole model, any layout
LAYOUTS = {  # activation checkpointing and expert parallelism ride along (they change nothing)
    "dp4": [],
    "tp2_dp2": ["parallel.tp=2", "parallel.ep=2", "parallel.activation_checkpoint=full"],
    "pp2_dp2": ["parallel.pp=2", "parallel.pp_schedule=GPipe", "parallel.ep=2"],
    "pp2_tp2": ["parallel.pp=2", "parallel.tp=2", "parallel.activation_checkpoint=selective"],
    "pp2v2_dp2": ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B",
                  "parallel.pp_virtual_stages=2"],
}
ZBV = ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "parallel.pp_virtual_stages=2"]
# the two remaining schedules (1F1B, GPipe, Interleaved1F1B above; ZBVZeroBubble resumes a
# layout switch below): 2 steps on 2 ranks (pp 2)
SCHEDULES = {
    "LoopedBFS": ["parallel.pp_schedule=LoopedBFS", "parallel.pp_virtual_stages=2"],
    "InterleavedZeroBubble": ["parallel.pp_schedule=InterleavedZeroBubble",
                              "parallel.pp_virtual_stages=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_pp")
    out = {n: root / n for n in ("ref", "ref_fp32", "pp2_tp2_fp32", "to_zbv", "to_one",
                                 *LAYOUTS, *SCHEDULES)}
    fp32 = ["train.steps=3", "checkpoint.enabled=false"]
    pretrain_concurrently((out["ref"], [*ARGS, IMAGES]), (out["ref_fp32"], fp32))  # 1 rank each
    # layout switches at step 3, then the run goes on unchanged: one rank -> pp2 x dp2 (zero-
    # bubble V); tp2 x dp2 x ep2 -> one rank
    _copy_step3(out["ref"], out["to_zbv"])
    four = [*((out[n], [*ARGS, IMAGES, *e]) for n, e in LAYOUTS.items()),
            (out["pp2_tp2_fp32"], [*fp32, *LAYOUTS["pp2_tp2"]]), (out["to_zbv"], [*ARGS, *ZBV])]
    two = [(out[n], [*ARGS, "train.stop_at_step=2", "parallel.pp=2", *e])
           for n, e in SCHEDULES.items()]
    out["refused"] = {}
    for jobs, nproc in ((four, 4), (two, 2)):
        if not ZERO_BUBBLE_RUNS:
            for d, o in [j for j in jobs if j[0].name in ZERO_BUBBLE_JOBS]:
                jobs.remove((d, o))
                out["refused"][d.name] = pretrain(d, *o, nproc=nproc, check=False)
        pretrain_many(jobs, nproc=nproc)
    _copy_step3(out["tp2_dp2"], out["to_one"])
    pretrain(out["to_one"], *ARGS)
    return out


def _copy_step3(src, dst):
    shutil.copytree(src / "checkpoints" / "step-00000003", dst / "checkpoints" / "step-00000003")


def _close(got: float, ref: float, rel: float = 1e-4) -> bool:
    return abs(got - ref) <= rel * abs(ref)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_equal_one_rank(runs, name):
    ref, got = metrics(runs["ref"]), metrics(runs[name])
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for r, g in zip(ref, got, strict=True):
        assert _close(g["loss"], r["loss"], 1e-6), (name, r["step"], g["loss"], r["loss"])
        assert _close(g["grad_norm"], r["grad_norm"], 1e-6), (name, g["grad_norm"])
        # routing statistics gathered over pipeline stages and summed over sequence slices
        assert _close(g["expert_load_max_over_mean"], r["expert_load_max_over_mean"], 1e-9)
    assert _close(got[-1]["val_loss"], ref[-1]["val_loss"], 1e-9), (name, got[-1], ref[-1])
    if "parallel.ep=2" in LAYOUTS[name]:
        assert all(len(m["ep_rank_load_static"]) == 7 for m in got)  # one per MoE layer


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_images_equal_one_rank(runs, name):
    """Expert load, router bias and AttnRes depth weights of the whole model: gathered over
    pipeline stages (the image row sent through the stages), averaged over sequence slices."""
    ref, got = (np.load(runs[n] / "plots" / "images-step-00000004.npz") for n in ("ref", name))
    assert (runs[name] / "plots" / "attnres_depth-step-00000004.png").stat().st_size > 0
    assert np.array_equal(got["moe_layer_ids"], ref["moe_layer_ids"]) and len(ref["moe_layer_ids"])
    assert np.array_equal(got["attnres_labels"], ref["attnres_labels"])
    assert np.array_equal(got["expert_load"], ref["expert_load"]) and ref["expert_load"].sum()
    np.testing.assert_allclose(got["router_bias"], ref["router_bias"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["attnres_weights"], ref["attnres_weights"], rtol=0, atol=1e-9)


def _refused(runs, name: str) -> bool:
    """True if this torch refuses the job's zero-bubble schedule, after checking it did so in
    one line (below torch 2.13)."""
    r = runs["refused"].get(name)
    if r is not None:
        assert r.returncode != 0 and "needs torch>=2.13" in r.stderr, r.stderr[-2000:]
    return r is not None


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_equal_one_rank(runs, name):
    if _refused(runs, name):
        return
    ref, got = losses(runs["ref"]), losses(runs[name])
    assert sorted(got) == [1, 2]
    for s in got:
        assert _close(got[s], ref[s], 1e-6), (name, s, got[s], ref[s])


def test_fp32_losses_equal_one_rank(runs):
    ref, got = losses(runs["ref_fp32"]), losses(runs["pp2_tp2_fp32"])
    assert sorted(got) == [1, 2, 3]
    for s in ref:
        assert _close(got[s], ref[s]), (s, got[s], ref[s])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parameters_equal_one_rank(runs, name):
    assert len(assert_parameters_equal(runs["ref"], runs[name], 4)) > 50


@pytest.mark.parametrize("name", ["to_zbv", "to_one"])
def test_resume_under_another_layout(runs, name):
    if _refused(runs, name):
        return
    ref, got = metrics(runs["ref"]), metrics(runs[name])
    assert [m["step"] for m in got] == [4]  # steps 1-3 came from the other layout
    for g in got:
        r = ref[g["step"] - 1]
        assert _close(g["loss"], r["loss"], 1e-6), (name, g["step"], g["loss"], r["loss"])
        assert g["sample_ids"] == r["sample_ids"]  # the loader resumed at the same sample
        assert _close(g["val_loss"], r["val_loss"], 1e-9), (name, g["val_loss"], r["val_loss"])


def test_same_samples_in_every_layout(runs):
    ref = {m["step"]: m["sample_ids"] for m in metrics(runs["ref"])}
    for name in LAYOUTS:
        assert {m["step"]: m["sample_ids"] for m in metrics(runs[name])} == ref, name

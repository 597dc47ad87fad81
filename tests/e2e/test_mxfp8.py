"""precision=mxfp8 through the real launcher: trains like fp32 and composes with FSDP."""

from __future__ import annotations

import pytest

from tests.helpers.runs import losses, pretrain_concurrently, pretrain_many

ARGS = ["train.steps=30", "checkpoint.enabled=false", "data.micro_batch=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mx")
    out = {"fp32": root / "fp32", "mx": root / "mx", "mx2": root / "mx2",
           "mx_tp_ep": root / "tp_ep"}
    # the one-rank MX run (2 micro-batches) sums them as FSDP2 does, not by fused accumulation
    # (addmm into the buffer rounds differently), so 2 ranks x 1 micro-batch must equal it
    _, r = pretrain_concurrently((out["fp32"], ARGS),
                                 (out["mx"], [*ARGS, "precision=mxfp8",
                                              "parallel.fuse_grad_accumulation=false"]))
    out["log"] = r.stdout
    mx = [*ARGS, "precision=mxfp8"]
    # FSDP 2; tp 2 on 2 ranks with the experts spread over the same two ranks (ep borrows tp
    # ranks), and per-op activation checkpointing recomputing the MX GEMMs' neighbours
    pretrain_many([(out["mx2"], [*mx, "train.stop_at_step=8"]),
                   (out["mx_tp_ep"], [*mx, "train.stop_at_step=4", "parallel.tp=2",
                                      "parallel.ep=2",
                                      "parallel.activation_checkpoint=selective"])], nproc=2)
    return out


def test_log_names_the_backend(runs):
    assert "precision: MXFP8 (linears emulated, experts emulated; rceil)" in runs["log"]


def test_mxfp8_ends_within_two_percent_of_fp32(runs):
    fp32, mx = losses(runs["fp32"]), losses(runs["mx"])
    assert len(mx) == 30
    assert mx != fp32  # the quantised run is really different
    end_fp32 = sum(fp32[s] for s in range(26, 31)) / 5
    end_mx = sum(mx[s] for s in range(26, 31)) / 5
    assert abs(end_mx - end_fp32) <= 0.02 * end_fp32, (end_mx, end_fp32)
    assert end_mx < mx[1] - 1.0  # and it trains


def test_mxfp8_under_fsdp_equals_one_rank(runs):
    """Same micro-batches on 2 FSDP ranks as on 1 rank: the MX blocks (also the wgrad blocks
    along tokens) are the same, so the losses agree to fp32 reduction noise (here exactly:
    one rank adds its two micro-batches' gradients in the order the reduce-scatter does; with
    fused accumulation the rounding differs, 7e-6 by step 3 and 8e-5 by step 8 after AdamW)."""
    one, two = losses(runs["mx"]), losses(runs["mx2"])
    for s in range(1, 9):
        assert abs(two[s] - one[s]) <= 1e-5 * abs(one[s]), (s, two[s], one[s])


def test_mxfp8_composes_with_tensor_and_expert_parallelism_and_checkpointing(runs):
    """MXFP8 linears on tensor-parallel shards (dense MLP and shared experts split by columns,
    down projections by rows; every local contraction dim a multiple of 32) and MXFP8 grouped
    GEMMs over MoonEP groups (home experts + replicas). The forward quantises per token along K,
    so step 1 equals one rank to fp32 noise; the wgrad blocks run along tokens, which sequence
    parallelism and EP order and group differently, so later steps agree to MX noise only."""
    one, got = losses(runs["mx"]), losses(runs["mx_tp_ep"])
    assert abs(got[1] - one[1]) <= 1e-5 * one[1], (got[1], one[1])
    assert sorted(got) == [1, 2, 3, 4]
    for s in range(2, 5):
        assert abs(got[s] - one[s]) <= 1e-2 * one[s], (s, got[s], one[s])

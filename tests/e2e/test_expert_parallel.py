"""Expert parallelism (MoonEP dispatch, dynamic replicas) through the real launcher: the same
losses as one rank, balanced EP ranks, the same Quantile-Balancing biases. An EP checkpoint
resuming on one rank: `test_tensor_pipeline.py` (tp2 x dp2 x ep2 -> one rank)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import losses, metrics, pretrain

ARGS = ["train.steps=6", "checkpoint.interval=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    out = {n: root / n for n in ("ref", "ep2_static", "ep4", "ep2_edp2", "ep4_tp2")}
    pretrain(out["ref"], *ARGS)
    pretrain(out["ep2_static"], *ARGS, "parallel.ep=2", "parallel.ep_replicas=false", nproc=2)
    pretrain(out["ep4"], *ARGS, "parallel.ep=4", nproc=4, timeout=600)
    # 4 data ranks, experts over 2 ep ranks and FSDP-sharded over the 2 expert-data ranks
    pretrain(out["ep2_edp2"], *ARGS, "parallel.ep=2", nproc=4, timeout=600)
    # dp_shard 2 x tp 2: the ep group spans both dp and both tp ranks (ep borrows tp ranks)
    pretrain(out["ep4_tp2"], *ARGS, "parallel.ep=4", "parallel.tp=2", nproc=4, timeout=600)
    return out


@pytest.mark.parametrize("name", ["ep2_static", "ep4", "ep2_edp2", "ep4_tp2"])
def test_losses_equal_one_rank(runs, name):
    ref, got = losses(runs["ref"]), losses(runs[name])
    assert sorted(got) == list(range(1, 7))
    for s in ref:
        assert abs(got[s] - ref[s]) <= 1e-4 * abs(ref[s]), (name, s, got[s], ref[s])


def test_replicas_balance_ep_ranks(runs):
    for m in metrics(runs["ep4"]):
        assert len(m["ep_rank_load_static"]) == 7  # one value per MoE layer
        assert m["ep_rank_load_replicated_mean"] <= 1.01  # exact S*K (+-1 pair) per rank
        assert m["ep_rank_load_replicated_mean"] <= m["ep_rank_load_static_mean"]
    static = [m["ep_rank_load_replicated_mean"] for m in metrics(runs["ep2_static"])]
    assert max(static) > 1.01  # without replicas the EP ranks are unbalanced


def test_quantile_balancing_equal_under_ep(runs):
    from train.export_hf import load_model

    biases = []
    for name in ("ref", "ep4"):
        model, _ = load_model(runs[name] / "checkpoints" / "step-00000003")
        biases.append(torch.stack([m.gate.e_score_correction_bias for m in model.moe_layers()]))
    assert biases[0].abs().max() > 0
    torch.testing.assert_close(biases[0], biases[1], rtol=0, atol=1e-5)

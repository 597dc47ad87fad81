"""Expert parallelism (MoonEP dispatch, dynamic replicas) through the real launcher: every EP layout
trains to the same per-step losses, gradient norms, parameters and validation loss as one rank (fp64
verification mode, as the TP/PP layouts in `test_tensor_pipeline.py`), with balanced EP ranks and
the same Quantile-Balancing biases. Losses alone would not do: multiplying every routed-expert
gradient by 4 moves 6-step debug losses by only 1.8e-5, but the gradient norm by far more than the
1e-6 bound here. ep4 x tp2 also runs full activation checkpointing, whose recompute reuses the
forward's MoonEP routes; dp_replicate 2 x ep 2 is HSDP with EP inside each replica group. A short
fp32 run counts host reads: one per MoE layer and micro-batch. An EP checkpoint resuming on one
rank: `test_tensor_pipeline.py` (tp2 x dp2 x ep2 -> one rank)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import assert_parameters_equal, close, metrics, pretrain, pretrain_many

ARGS = ["train.steps=4", "checkpoint.interval=3", "cluster.param_dtype=fp64",
        "eval.every=4", "eval.batches=2"]
LAYOUTS = {
    "ep2_static": (["parallel.ep=2", "parallel.ep_replicas=false"], 2),
    "ep4": (["parallel.ep=4"], 4),
    # 4 data ranks, experts over 2 ep ranks and FSDP-sharded over the 2 expert-data ranks
    "ep2_edp2": (["parallel.ep=2"], 4),
    # dp_shard 2 x tp 2: the ep group spans both dp and both tp ranks (ep borrows tp ranks);
    # 2 micro-batches per step, recomputed in backward with the forward's routes
    "ep4_tp2": (["parallel.ep=4", "parallel.tp=2", "parallel.activation_checkpoint=full"], 4),
    # HSDP x EP: two replica groups of dp_shard 2 = ep 2; expert grads all-reduced over replicas
    "hsdp2_ep2": (["parallel.dp_replicate=2", "parallel.ep=2"], 4),
}
SYNCS = ["train.steps=1", "parallel.ep=2", "parallel.activation_checkpoint=selective",
         "train.count_host_syncs=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    out = {n: root / n for n in ("ref", *LAYOUTS)}
    out["syncs"] = root / "syncs"
    pretrain(out["ref"], *ARGS)
    for nproc in (2, 4):  # one launch per world size
        jobs = [(out[name], [*ARGS, *extra]) for name, (extra, n) in LAYOUTS.items() if n == nproc]
        pretrain_many(jobs + ([(out["syncs"], SYNCS)] if nproc == 2 else []), nproc=nproc)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_and_grad_norms_equal_one_rank(runs, name):
    ref, got = metrics(runs["ref"]), metrics(runs[name])
    assert [m["step"] for m in got] == list(range(1, 5))
    for r, g in zip(ref, got, strict=True):
        assert close(g["loss"], r["loss"], 1e-6), (name, r["step"], g["loss"], r["loss"])
        assert close(g["grad_norm"], r["grad_norm"], 1e-6), (name, r["step"], g["grad_norm"],
                                                              r["grad_norm"])
    # validation in eval mode: MoonEP dispatch without statistics or replanning
    assert close(got[-1]["val_loss"], ref[-1]["val_loss"], 1e-9), (name, got[-1], ref[-1])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parameters_equal_one_rank(runs, name):
    compared = assert_parameters_equal(runs["ref"], runs[name], 4)
    assert sum(".experts." in k for k in compared) == 21  # w1, w3, w2 of the 7 MoE layers


def test_replicas_balance_ep_ranks(runs):
    for m in metrics(runs["ep4"]):
        assert len(m["ep_rank_load_static"]) == 7  # one value per MoE layer
        assert m["ep_rank_load_replicated_mean"] <= 1.01  # exact S*K (+-1 pair) per rank
        assert m["ep_rank_load_replicated_mean"] <= m["ep_rank_load_static_mean"]
    static = [m["ep_rank_load_replicated_mean"] for m in metrics(runs["ep2_static"])]
    assert max(static) > 1.01  # without replicas the EP ranks are unbalanced


def test_quantile_balancing_equal_under_ep(runs):
    from train.checkpoint.export_hf import load_model

    biases = []
    for name in ("ref", "ep4"):
        model, _ = load_model(runs[name] / "checkpoints" / "step-00000003")
        biases.append(torch.stack([m.gate.e_score_correction_bias for m in model.moe_layers()]))
    assert biases[0].abs().max() > 0
    torch.testing.assert_close(biases[0], biases[1], rtol=0, atol=1e-9)


def test_one_host_read_per_moe_layer(runs):
    """fp32 (no float64 reference GEMMs), 2 ranks x 2 micro-batches, selective checkpointing:
    the model reads the host once per MoE layer and micro-batch (the dispatch's split sizes) and
    never in the recompute, which reuses the forward's route."""
    for m in metrics(runs["syncs"]):
        assert m["host_syncs_model_by_op"] == [f"Tensor.tolist={7 * 2}"], m

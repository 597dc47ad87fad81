"""End-to-end: the real launcher under torchrun on CPU (gloo), FSDP2, DCP checkpoints, resume.

The runs are shared by the tests of this module (each costs seconds): A = 2 ranks straight to
step 12; B = 2 ranks stopped at 8 (A and B in one launch, `pretrain_many`), then resumed by the
launcher's same command; C = 1 rank straight, counting host synchronisations. A and B keep
their FSDP units gathered over each step's 2 micro-batches (`parallel.reshard_after_forward=
false`), so A against C also checks that gradient accumulation.
Resuming on another world size and layout: `test_tensor_pipeline.py`.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import close, losses, metrics, pretrain, pretrain_many, sample_ids

STEPS = ["train.steps=12", "checkpoint.interval=4"]
KEPT = [*STEPS, "parallel.reshard_after_forward=false"]


def assert_losses_match(got: dict[int, float], ref: dict[int, float]) -> None:
    """fp32 on different layouts: 1e-5 relative for the first 5 steps (what the issue asks),
    1e-3 later. Each step's Quantile-Balancing update may move one expert's bias per layer across
    a histogram bin edge (`test_quantile_balancing_is_layout_independent` allows it by step 4),
    and reduction-order noise can flip a near-tied top-k choice; either changes the routing, so
    the two layouts drift past 1e-5 after a few steps (seen: 2e-5 at step 8 with the packages of
    2026-12-03). A real layout bug moves the loss by >1e-2 from step 1."""
    assert sorted(got) == sorted(ref)
    for s in ref:
        tol = 1e-5 if s <= 5 else 1e-3
        assert abs(got[s] - ref[s]) <= tol * abs(ref[s]), (s, got[s], ref[s])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    out["A"], out["B"] = root / "A", root / "B"
    pretrain_many([(out["A"], KEPT), (out["B"], [*KEPT, "train.stop_at_step=8"])], nproc=2)
    out["B_first"] = losses(out["B"])
    pretrain(out["B"], *KEPT, nproc=2)  # the same command: resumes from step 8
    out["C"] = root / "C"
    pretrain(out["C"], *STEPS, "train.count_host_syncs=true", nproc=1)
    return out


def test_loss_falls(runs):
    loss = losses(runs["A"])
    assert sorted(loss) == list(range(1, 13))
    assert loss[12] < loss[1] - 0.5, loss


def test_run_directory_contents(runs):
    a = runs["A"]
    assert (a / "config.yaml").is_file()
    steps = sorted(p.name for p in (a / "checkpoints").iterdir())
    assert steps == ["step-00000004", "step-00000008", "step-00000012"]
    state = json.loads((a / "checkpoints" / "step-00000012" / "train_state.json").read_text())
    assert state["step"] == 12 and state["loader"]["position"] == 12 * 8
    for m in metrics(a):
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec"} <= m.keys()


def test_exact_resume_is_bit_identical(runs):
    a, b = losses(runs["A"]), losses(runs["B"])
    assert sorted(runs["B_first"]) == list(range(1, 9))
    assert sorted(b) == list(range(1, 13))  # steps 9-12 appended once, no duplicates
    for s in range(1, 13):
        assert b[s] == a[s], (s, a[s], b[s])


def test_fsdp_two_ranks_equal_one_rank(runs):
    """Losses (see assert_losses_match), the data order, and the gradient norms: step 1's to
    1e-6 (the same weights; only the fp32 reduction order differs, seen 1e-9), steps 2-4 to
    1e-3. After the first update the weights differ by fp32 rounding, and AdamW's m / sqrt(v)
    turns the relative noise of near-zero gradients into updates of order lr, so the norms
    drift apart by 1e-5 .. 1e-4 (seen on a 2026-12-04 machine, fused or unfused gradient
    accumulation alike); the float64 layout runs (tests/e2e/test_expert_parallel.py, ...)
    hold every step to 1e-6."""
    assert_losses_match(losses(runs["A"]), losses(runs["C"]))
    assert sample_ids(runs["A"]) == sample_ids(runs["C"])
    norms = [{m["step"]: m["grad_norm"] for m in metrics(runs[r])} for r in ("A", "C")]
    for s in range(1, 5):
        tol = 1e-6 if s == 1 else 1e-3
        assert close(norms[0][s], norms[1][s], tol), (s, norms[0][s], norms[1][s])


def test_quantile_balancing_is_layout_independent(runs):
    """Step 4's router biases: 2 ranks x 2 micro-batches == 1 rank x 4 micro-batches (hard-parts
    §3: histograms summed over micro-batches and ranks, one update per step)."""
    import torch

    from model.balancing import margin_bounds
    from train.checkpoint.export_hf import load_model

    biases = {}
    for name in ("A", "C"):
        model, state = load_model(runs[name] / "checkpoints" / "step-00000004")
        assert state["step"] == 4
        biases[name] = torch.stack([m.gate.e_score_correction_bias for m in model.moe_layers()])
        assert not any(m.gate.qb_counts.any() for m in model.moe_layers())  # cleared each step
    assert biases["A"].abs().max() > 0  # QB has moved the biases
    # fp32: the layouts sum gradients in different orders, and AdamW turns that noise into
    # lr-sized weight differences after step 1 (its update of a near-zero gradient is about
    # +-lr either way), so by step 4 the routers' scores differ slightly: every interpolated
    # quantile moves a little (seen: per-layer medians up to 2e-4), and a margin that crosses a
    # histogram bin edge moves its expert's bias by up to one bin (the estimator's documented
    # error, (hi - lo) / num_bins, about 2e-3; seen 1.9e-3). Histograms not summed over ranks
    # or micro-batches estimate each quantile from a half or a quarter of the tokens, which
    # moves nearly every bias (one update from half of 512 tokens, 8 experts, top-2: per-layer
    # medians 3e-3 to 1e-2) and compounds over four updates. (The float64 EP and layout tests
    # check the biases exactly.)
    diff = (biases["A"] - biases["C"]).abs()
    for layer, bias in enumerate(biases["C"]):
        lo, hi = margin_bounds(bias)
        bin_width = (hi - lo) / model.config.qb_num_bins
        assert diff[layer].median() < 1e-3, (layer, diff[layer])
        assert diff[layer].max() < 2 * bin_width, (layer, diff[layer], bin_width)


def test_host_syncs_per_step(runs):
    """Inside the model's forward and backward nothing reads tensor data on the host. Outside
    it, per step: the loader's boundaries validated on the host (one `tolist` per micro-batch),
    the global token counts with the model FLOPs (one `tolist`), the loss sums (one `tolist`:
    the next-token and MTP sums together) and the gradient norm (one `float`). The optimizer
    reads nothing: torch's fused AdamW (`train.optim.build.build_optimizer`, CPU and CUDA) keeps its
    step counters as tensors it updates itself (the default per-parameter implementation read
    each one with `item`)."""
    for m in metrics(runs["C"]):
        assert m["host_syncs_model"] == 0, m["host_syncs_by_op"]
        assert m["host_syncs_by_op"] == ["Tensor.__float__=1", "Tensor.tolist=6"], \
            m["host_syncs_by_op"]


def test_attention_logits_tracked_without_qk_clip(runs):
    """`train.track_attn_logits` (default on: the debug model has MLA layers) with QK-Clip off
    (`optim=adamw`): every step logs attn_logit_max and one value per MLA layer, no clip count;
    2 ranks (each sees half the batch, the bounds reduced by MAX) equal 1 rank at step 1,
    where the weights are the same."""
    a, c = metrics(runs["A"]), metrics(runs["C"])
    for m in a + c:
        assert "qk_clipped_heads" not in m
        assert len(m["attn_logit_max_per_layer"]) == len(m["mla_layer_ids"]) > 0
        assert m["attn_logit_max"] == max(m["attn_logit_max_per_layer"])
    got, ref = a[0]["attn_logit_max_per_layer"], c[0]["attn_logit_max_per_layer"]
    assert a[0]["step"] == c[0]["step"] == 1
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)

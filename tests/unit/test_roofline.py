"""benchmarks/roofline.py: the traced op graph's FLOPs, bytes and predicted times on `debug`.

Checked against independent counts: the GEMM FLOPs of a traced step equal 6 x tokens x the
GEMM parameters (+ the chunked loss's logit recompute), the custom-op formulas agree with
per-document causal counts and with `train.observe.flops`, one op's time is max(compute, memory) +
the launch overhead, and the categories add up to the step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from model.decoder import DecoderLayer, K3Model
from model.moe import RoutedExperts, Router

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
roofline = importlib.util.module_from_spec(_spec)
sys.modules["roofline"] = roofline
_spec.loader.exec_module(roofline)

SMALL = ["model=debug", "data.seq_len=32", "data.micro_batch=2", "data.docs_per_row=3"]
FIELDS = ("tokens", "model_flops", "traced_flops", "predicted_step_s", "predicted_mfu", "kernels",
          "by_category", "non_gemm_fraction", "comm_bytes", "gpu", "preset", "seq_len",
          "micro_batch")


@pytest.fixture(scope="module")
def debug_step():
    """The CLI on a small debug step (--table): its JSON line, its table, the op records (kept
    from the same trace)."""
    seen = {}
    analyze = roofline.analyze

    def keep(*args, **kwargs):
        seen["summary"], seen["records"] = analyze(*args, **kwargs)
        return seen["summary"], seen["records"]

    out, err = io.StringIO(), io.StringIO()
    roofline.analyze = keep
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = roofline.main([*SMALL, "--gpu", "h200", "--table"])
    finally:
        roofline.analyze = analyze
    assert rc == 0, err.getvalue()
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    assert summary == json.loads(json.dumps(seen["summary"]))
    return summary, err.getvalue(), seen["records"], roofline.load_config(SMALL)


def test_op_time_is_max_of_compute_and_memory_plus_launch():
    g = roofline.GPUS["h200"]
    us = roofline.KERNEL_OVERHEAD_S
    assert roofline.op_time(790e9, 4.3e6, g, matmul=True) == pytest.approx(1e-3 + us)
    assert roofline.op_time(790e6, 4.3e9, g, matmul=True) == pytest.approx(1e-3 + us)
    assert roofline.op_time(67e9, 1.0, g, matmul=False) == pytest.approx(1e-3 + us)  # vector
    assert roofline.op_time(1e9, 1e9, g, matmul=False, kernels=3) == pytest.approx(
        max(1e9 / 67e12, 1e9 / 4.3e12) + 3 * us)
    assert roofline.op_time(1e9, 1e9, g, matmul=True, kernels=0) == 0.0
    mm = roofline.OpRecord("aten.mm", "gemm", "forward", 1.58e12, 0.0, 4.3e6, 1)
    add = roofline.OpRecord("aten.add", "elementwise_norm", "forward", 0.0, 1e6, 8.6e9, 1)
    assert mm.time(g) == pytest.approx(2e-3 + us) and add.time(g) == pytest.approx(2e-3 + us)
    assert mm.time(roofline.GPUS["b200"]) == pytest.approx(1.58e12 / 1.8e15 + us)
    fp32 = roofline.OpRecord("aten.mm", "gemm", "forward", 67e9, 0.0, 4.3e6, 1, fp32_gemm=True)
    assert fp32.time(g) == pytest.approx(1e-3 + us)  # CUDA cores: TF32 is off by default


def test_fp32_gemms_are_told_apart_by_their_operands():
    """The router's fp32 GEMM is fp32; a bf16 GEMM writing fp32 (mm.dtype, addmm.dtype_out:
    the loss) is not."""
    f32, b16 = torch.empty(4, 8), torch.empty(4, 8, dtype=torch.bfloat16)
    assert roofline._fp32_gemm("aten.mm", (f32, f32.t()))
    assert roofline._fp32_gemm("aten.addmm", (torch.empty(4), f32, f32.t()))
    assert not roofline._fp32_gemm("aten.mm", (b16, b16.t(), torch.float32))
    assert not roofline._fp32_gemm("aten.addmm", (f32[:, :4], b16, b16.t(), torch.float32))
    assert not roofline._fp32_gemm("aten.mul", (f32, f32))


def test_linear_forward_backward_gemm_flops_are_6_in_out_tokens():
    tokens, d_in, d_out = 48, 64, 96
    lin = nn.Linear(d_in, d_out, bias=False, device="meta").to(torch.bfloat16)

    def forward():
        lin.to_empty(device="cpu")
        x = torch.randn(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
        return lin(x)

    records = roofline.trace_ops(forward, backward=lambda y: y.backward(torch.ones_like(y)))
    gemms = [r for r in records if r.category == "gemm"]
    assert [r.name for r in gemms] == ["aten.mm"] * 3  # y, dx, dw
    assert sum(r.flops for r in gemms) == 6 * d_in * d_out * tokens
    fwd = gemms[0]
    assert fwd.phase == "forward" and fwd.nbytes == 2 * (tokens * d_in + d_in * d_out
                                                         + tokens * d_out)
    assert all(r.kernels == 1 for r in gemms)


def test_custom_op_formulas_count_causal_pairs_per_document():
    from model.config import load_model_config
    from train.observe.flops import kda_flops_per_token

    lengths = [3, 5, 40]
    f = roofline._Formulas(lengths)
    N, H, D, Dv = sum(lengths), 4, 24, 16
    q = torch.empty(N, H, D, device="meta")
    v = torch.empty(N, H, Dv, device="meta")
    cu = torch.empty(len(lengths) + 1, dtype=torch.int32, device="meta")
    pairs = sum(sum(range(1, n + 1)) for n in lengths)  # query i sees keys 0..i of its document
    assert f("k3.varlen_attention", (q, q, v, cu, 40, 0.1)) == 2 * H * pairs * (D + D)
    bwd = f("k3.varlen_attention_backward", (v, q, q, v, v, None, cu, 40, 0.1))
    assert bwd == 2 * H * pairs * (3 * D + 2 * D)
    cfg = load_model_config("debug")
    K = cfg.kda_head_dim
    qk = torch.empty(1, N, cfg.kda_num_heads, K, device="meta")
    kda = f("k3.chunk_kda_fla", (qk, qk, qk, qk, None, None, cu, None, 0.1, False,
                                 cfg.kda_chunk_size))
    assert kda == pytest.approx(sum(n * kda_flops_per_token(cfg, n) / 3 for n in lengths))
    x, w = torch.empty(10, 8, device="meta"), torch.empty(3, 6, 8, device="meta")
    assert f("k3.grouped_mm", (x, w, None)) == 2 * 10 * 8 * 6
    with pytest.raises(ValueError, match="host document lengths"):
        roofline._Formulas([3, 4])("k3.varlen_attention", (q, q, v, cu, 40, 0.1))


def test_debug_step_json_categories_and_mfu(debug_step):
    summary, table, *_ = debug_step
    assert all(k in summary for k in FIELDS)
    assert (summary["gpu"], summary["preset"], summary["seq_len"], summary["micro_batch"]) == (
        "H200", "debug", 32, 2)
    assert summary["tokens"] == 64 and sum(summary["doc_lengths"]) == 64
    cats = summary["by_category"]
    assert set(cats) == set(roofline.CATEGORIES)
    assert sum(c["s"] for c in cats.values()) == pytest.approx(summary["predicted_step_s"],
                                                                rel=1e-12)
    assert sum(c["kernels"] for c in cats.values()) == summary["kernels"] > 0
    assert all(cats[c]["s"] > 0 for c in roofline.CATEGORIES)  # debug has every component
    assert 0 < summary["predicted_mfu"] < 1 and 0 < summary["non_gemm_fraction"] < 1
    compute = sum(cats[c]["s"] for c in roofline.COMPUTE_CATEGORIES)
    assert summary["non_gemm_fraction"] == pytest.approx(1 - compute / summary["predicted_step_s"])
    assert "aten.mm" in table and len(table.strip().splitlines()) == 21  # header + top 20


def test_traced_gemm_flops_equal_6_tokens_gemm_params(debug_step):
    """Independent count: every GEMM weight is used once per token forward and twice backward
    (routed experts top-k / E of the time); the chunked loss forms its gradients in forward from
    the logits it has (model.loss_grads_in_forward), so its head runs 3 GEMMs, not 4."""
    summary, _, records, job = debug_step
    cfg, tokens = job.model, summary["tokens"]
    model = K3Model(cfg, device="meta")
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith("_res_proj"):
            n += mod.weight.numel()  # AttnRes pseudo-queries are not GEMMs
        elif isinstance(mod, Router):
            n += mod.weight.numel()
        elif isinstance(mod, RoutedExperts):
            n += sum(p.numel() for p in mod.parameters()) * cfg.num_experts_per_token \
                // cfg.num_experts
    assert cfg.loss_grads_in_forward
    expected = 6 * tokens * n
    gemm = sum(r.count * r.flops for r in records if r.category == "gemm")
    assert gemm == pytest.approx(expected, rel=1e-12)
    assert summary["by_category"]["gemm"]["flops"] == pytest.approx(expected, rel=1e-12)
    assert summary["model_flops"] > 0


@pytest.mark.parametrize("idx,kind,has,lacks", [(0, "kda+dense", "kda", "attention"),
                                                (3, "mla+moe", "attention", "kda")])
def test_one_layer_has_its_token_mixer_time(idx, kind, has, lacks):
    s = roofline.roofline(SMALL, gpu="b200", layer=idx)
    assert s["layer_kind"] == kind and s["gpu"] == "B200"
    assert s["by_category"][has]["s"] > 0 and s["by_category"][lacks]["s"] == 0
    assert s["by_category"]["loss"]["s"] == 0 and s["kernels"] > 0
    assert 0 < s["predicted_mfu"] < 1


def test_layer_model_flops_add_up_to_the_trainers_count():
    from train.observe.flops import step_flops

    cfg = roofline.load_config(SMALL).model
    lengths = [11, 21, 32, 16, 16]
    model = K3Model(cfg, device="meta")
    layers = sum(roofline._layer_model_flops(cfg, DecoderLayer(cfg, i, "meta"), i, lengths)
                 for i in range(cfg.num_hidden_layers))
    root = [model.lm_head, model.norm, model.output_attn_res_norm, model.output_attn_res_proj]
    rest = 6 * sum(lengths) * sum(p.numel() for m in root for p in m.parameters())
    assert layers + rest == pytest.approx(step_flops(cfg, lengths), rel=1e-12)


def test_comm_bytes_follow_the_layout():
    job = roofline.load_config([*SMALL, "parallel.tp=2", "parallel.ep=2"], world=4)
    cfg, d = job.model, job.job.data
    by_dim, detail = roofline.comm_bytes(job, K3Model(cfg, device="meta"), None)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert job.micro_batches == d.global_batch // (job.dims.dp * d.micro_batch) == 4
    tokens = 4 * d.micro_batch * d.seq_len / 2  # per step and tp rank (sequence parallel)
    ep_tokens = 2 * 2 * tokens * cfg.num_experts_per_token * cfg.routed_expert_hidden_size * 2 \
        * (1 / 2) * moe_layers
    assert detail["ep_tokens"] == round(ep_tokens) and by_dim["ep"] > ep_tokens
    assert by_dim["tp"] > 0 and by_dim["dp_shard"] > 0 and by_dim["pp"] == 0
    assert by_dim["dp_replicate"] == 0 and job.dims.edp == 2 and by_dim["edp"] > 0
    one = roofline.comm_bytes(roofline.load_config(SMALL, world=1),
                              K3Model(cfg, device="meta"), None)[0]
    assert all(v == 0 for v in one.values())
    pp = roofline.load_config([*SMALL, "parallel.pp=2", "data.global_batch=4"], world=2)
    assert roofline.comm_bytes(pp, K3Model(cfg, device="meta"), None)[0]["pp"] > 0


@pytest.mark.parametrize("idx", [1, 3])  # KDA+MoE, MLA+MoE
def test_compiled_layer_keeps_every_gemm_and_fuses_the_glue(idx):
    """--compiled: one forward and one backward graph; the GEMM, attention and KDA records are
    the eager trace's exactly; inductor's fused kernels replace the glue with fewer kernels and
    fewer bytes."""
    eager = roofline.roofline(SMALL, gpu="h200", layer=idx)
    comp = roofline.roofline(SMALL, gpu="h200", layer=idx, compiled=True)
    assert comp["compiled"] and comp["compiled_graphs"] == 2
    for cat in ("gemm", "attention", "kda"):
        assert comp["by_category"][cat]["flops"] == pytest.approx(
            eager["by_category"][cat]["flops"], rel=1e-12), cat
    glue = ("elementwise_norm", "attnres", "moe_routing")
    kernels = lambda s: sum(s["by_category"][c]["kernels"] for c in glue)  # noqa: E731
    nbytes = lambda s: sum(s["by_category"][c]["bytes"] for c in glue)  # noqa: E731
    assert kernels(comp) < kernels(eager) and nbytes(comp) < nbytes(eager)
    assert comp["fwd_bwd_s"] < eager["fwd_bwd_s"]
    assert sum(comp["unmatched_externs"].values()) <= 1  # the router's scatter_reduce at most


def test_compiled_pointwise_chain_is_one_kernel_reading_x_writing_y():
    """Oracle: y = relu(2x + 1) is one fused inductor kernel that reads x and writes y."""
    trace = roofline.Trace()
    regions = roofline.CompiledRegions(trace, roofline)
    fn = torch.compile(lambda x: torch.relu(2 * x + 1), backend=regions.backend)
    torch._dynamo.reset()
    with torch._subclasses.fake_tensor.FakeTensorMode(), trace.recording("forward"):
        fn(torch.empty(1024, 64))
    records, unmatched = regions.substitute(trace.records)
    assert unmatched == {} and len(regions.regions) == 1
    assert [(r.name, r.kernels, r.nbytes) for r in records] == [
        ("inductor.pointwise", 1, 2 * 1024 * 64 * 4)]


def test_gradient_accumulation_repeats_forward_backward_not_the_step(debug_step):
    """data.global_batch = 2 x dp x micro_batch: forward and backward run twice, the QB update,
    clip and AdamW once; without fusion FSDP2 adds its fp32 gradient accumulator (one copy after
    the first backward, one add after the second, a kernel per parameter tensor); the trainer's
    FLOPs and tokens double."""
    one, _, one_records, job = debug_step
    two, records = roofline.analyze([*SMALL, "data.global_batch=32",
                                     "parallel.fuse_grad_accumulation=false"], gpu="h200")
    assert (one["micro_batches"], two["micro_batches"]) == (1, 2)
    assert two["tokens"] == 2 * one["tokens"] and two["model_flops"] == 2 * one["model_flops"]
    for phase in ("forward", "backward"):
        assert two["by_phase"][phase] == pytest.approx(2 * one["by_phase"][phase], rel=1e-9)
    assert two["by_phase"]["step_end"] == pytest.approx(one["by_phase"]["step_end"], rel=1e-9)
    adam = lambda rs: sum(r.time(roofline.GPUS["h200"]) for r in rs  # noqa: E731
                          if r.phase == "optimizer" and not r.name.startswith("fsdp."))
    assert adam(records) == pytest.approx(adam(one_records), rel=1e-9)
    model = K3Model(job.model, device="meta")
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    by_name = {r.name: r for r in records if r.name.startswith("fsdp.")}
    assert (by_name["fsdp.grad_to_fp32"].count, by_name["fsdp.grad_accumulate"].count) == (1, 1)
    assert by_name["fsdp.grad_accumulate"].kernels == tensors
    assert by_name["fsdp.grad_accumulate"].nbytes == 10 * params  # fp32 += bf16
    assert by_name["fsdp.all_gather_copy_in"].count == 2  # regathered each micro-batch
    assert not any(r.name.startswith("fsdp.grad_") for r in one_records)
    assert two["comm_bytes"]["dp_shard"] > one["comm_bytes"]["dp_shard"]


def test_fused_accumulation_moves_the_adds_into_the_wgrad_gemms():
    """With fusion (the default for 2+ micro-batches): the same GEMM FLOPs, the fusable weights'
    gradient GEMMs become `k3::wgrad_accumulate` / `k3::grouped_wgrad_accumulate` (reading and
    writing their fp32 buffer), FSDP2's cast and add cover only the other parameters, the
    buffers are zeroed once a step (4 B per element), and the step is predicted faster."""
    base = [*SMALL, "data.global_batch=32"]
    plain, plain_records = roofline.analyze([*base, "parallel.fuse_grad_accumulation=false"],
                                            gpu="h200")
    fused, records = roofline.analyze(base, gpu="h200")
    assert fused["traced_flops"] == pytest.approx(plain["traced_flops"], rel=1e-12)
    names = Counter(r.name for r in records)
    assert names["k3.wgrad_accumulate"] > 0 and names["k3.grouped_wgrad_accumulate"] > 0
    assert "k3.grouped_mm_wgrad" not in names and "k3.grouped_mm_wgrad" in {
        r.name for r in plain_records}
    model = K3Model(roofline.load_config(SMALL).model, device="meta")
    from parallel.grad_accumulation import fusable
    fused_elems = sum(p.numel() for m in model.modules()
                      for n, p in m.named_parameters(recurse=False) if fusable(m, n))
    params = sum(p.numel() for p in model.parameters())
    acc = {r.name: r for r in records if r.name.startswith("fsdp.grad_")}
    assert acc["fsdp.grad_accumulate"].nbytes == 10 * (params - fused_elems)
    zero = [r for r in records if r.name == "aten._foreach_zero_" and r.phase == "optimizer"]
    assert sum(r.nbytes for r in zero) == 4 * fused_elems
    assert fused["predicted_step_s"] < plain["predicted_step_s"]


def test_kept_gathered_units_copy_once_per_step():
    """parallel.reshard_after_forward=false: every unit is gathered once per step, however many
    micro-batches (parallel.fsdp.set_gradient_sync(keep_gathered=True))."""
    model = K3Model(roofline.load_config(SMALL).model, device="meta")
    units = roofline._fsdp_units(model, None, reshard=False)
    assert [g for _, g, _ in units] == [1] * (len(model.decoder_layers()) + 1)
    assert sum(t for _, _, t in units) == len(list(model.parameters()))
    trace = roofline.Trace()
    roofline._fsdp_copies(trace, units, micro_batches=4, keep_gathered=True)
    copy_in = next(r for r in trace.records if r.name == "fsdp.all_gather_copy_in")
    assert (copy_in.count, copy_in.kernels) == (1, len(units))
    assert copy_in.nbytes == 6 * sum(p.numel() for p in model.parameters())
    reshard = roofline._fsdp_units(model, None)
    assert sum(g for _, g, _ in reshard) == 2 * len(units) - 2  # last layer, root: 1


def test_loss_chunks_do_not_change_the_gemm_flops(debug_step):
    """4 loss chunks instead of 1: the head's gradient accumulates inside its GEMM
    (aten.addmm.dtype_out, counted by flop_counter like addmm), so the GEMM FLOPs stay 6 x
    tokens x parameters."""
    one, one_records = debug_step[0]["by_category"]["gemm"]["flops"], debug_step[2]
    s, records = roofline.analyze([*SMALL, "model.loss_chunk_tokens=16"], gpu="h200")
    addmm = lambda rs: sum(r.name == "aten.addmm" for r in rs)  # noqa: E731
    assert addmm(records) - addmm(one_records) == 3  # chunks 2-4
    assert s["by_category"]["gemm"]["flops"] == pytest.approx(one, rel=1e-12)


def test_unfused_ops_are_costed_as_their_pytorch_form():
    """--unfused: a fused op's record gives way to the ops of its PyTorch form (more kernels,
    more bytes, the same GEMMs); a name that is not a fused op is refused, naming the option."""
    fused, f_records = roofline.analyze(SMALL, layer=1)
    plain, p_records = roofline.analyze(SMALL, layer=1, unfused="all")
    assert plain["unfused"] == sorted(roofline.FUSED_OPS) and fused["unfused"] == []
    assert any(r.name in roofline.FUSED_OPS for r in f_records)
    assert not any(r.name in roofline.FUSED_OPS for r in p_records)
    assert plain["kernels"] > fused["kernels"]
    assert plain["by_category"]["gemm"]["flops"] == fused["by_category"]["gemm"]["flops"]
    glue = lambda s: sum(s["by_category"][c]["bytes"] for c in  # noqa: E731
                         ("elementwise_norm", "attnres", "moe_routing"))
    assert glue(plain) > glue(fused)
    assert roofline.unfused_ops("situ_glu") == {"k3.situ_glu", "k3.situ_glu_bwd"}
    with pytest.raises(ValueError, match="--unfused 'situ'"):
        roofline.unfused_ops("situ")

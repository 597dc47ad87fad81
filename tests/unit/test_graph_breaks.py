"""Whole-layer compile: every decoder layer type traces as ONE torch.compile graph.

For the dense KDA layer 0, a KDA+MoE layer and an MLA+MoE layer of a debug-size model (training
mode, fp32, several packed documents per row, a fresh `Packing` as each micro-batch has),
`torch._dynamo.explain` reports one graph and no graph break:
- with the CPU backends (explain runs the graph for real), bare and under activation
  checkpointing (`full`, `selective`: the layer's body is one checkpoint node);
- with every backend forced to its CUDA choice (`force_cuda_backends()`), traced under
  `FakeTensorMode` (explain runs the graph, here on fake tensors: the `k3::` custom ops' fake
  implementations stand in for fla and varlen attention).
The fast ops, and the KDA reference's chunk math (`k3::kda_chunk`), are single
`torch.ops.k3.*` nodes. Compiled (`fullgraph=True`, aot_eager) equals
eager for each layer type, Quantile-Balancing counts included, also when the compiled layer is
checkpointed (recomputation must not count twice). `apply_compile` gives every layer its graph
even when there are more distinct layers than dynamo's default recompile limit. The MTP
module's layer (no AttnRes state) is one graph as well.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from model.ops.backends import force_cuda_backends
from model.packing import Packing
from parallel.activation_checkpoint import apply_activation_checkpointing, apply_compile
from parallel.grad_accumulation import attach_local_main_grads
from tests.helpers.tiny import debug_config, packed_batch, tiny_model

LAYERS = {"kda_dense": 0, "kda_moe": 1, "mla_moe": 3}  # debug: layer 0 dense, MLA at 3 and 7


@pytest.fixture(scope="module")
def setup():
    """The debug model in train mode, a packed batch, and each layer's (prefix, blocks) input."""
    model = tiny_model()
    model.train()
    ids, _, cu = packed_batch(batch=2, seq=64)
    assert cu.numel() - 1 > 2 * 2  # several documents per row
    packing = Packing.from_host(cu, *ids.shape, ids.device)
    inputs = {}
    with torch.no_grad():
        prefix, blocks = model.embed(ids)
        for key, layer in model.layers.items():
            inputs[int(key)] = (prefix, blocks)
            prefix, blocks = layer(prefix, blocks, packing)
    return model, cu, ids.shape, inputs


def _fresh(cu: torch.Tensor, shape: torch.Size) -> Packing:
    return Packing.from_host(cu, *shape, "cpu")


def _k3_ops(graphs) -> collections.Counter:
    """`torch.ops.k3.*` call nodes in the graphs and their subgraphs (checkpoint bodies)."""
    ops: collections.Counter = collections.Counter()
    todo = list(graphs)
    while todo:
        gm = todo.pop()
        ops.update(str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("k3."))
        todo.extend(m for m in gm.children() if isinstance(m, torch.fx.GraphModule))
    return ops


def _assert_one_graph(explained, what: str) -> None:
    reasons = "\n".join(
        f"- {r.reason.strip()}\n  at " + " <- ".join(
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(r.user_stack[-4:]))
        for r in explained.break_reasons)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, (
        f"{what}: {explained.graph_count} graphs, {explained.graph_break_count} breaks:\n"
        f"{reasons}")


def _layer(setup, name: str):
    model, cu, shape, inputs = setup
    idx = LAYERS[name]
    layer = model.layers[str(idx)]
    assert (layer.layer_type, type(layer.ffn).__name__) == {
        "kda_dense": ("kda", "SiTUMLP"), "kda_moe": ("kda", "LatentMoE"),
        "mla_moe": ("mla", "LatentMoE")}[name]
    prefix, blocks = inputs[idx]
    return layer, prefix.detach().clone().requires_grad_(), blocks, cu, shape


@pytest.mark.parametrize("name", LAYERS)
def test_layer_is_one_graph_cpu_backends(setup, name):
    layer, prefix, blocks, cu, shape = _layer(setup, name)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(prefix, blocks, _fresh(cu, shape))
    _assert_one_graph(explained, name)
    ops = _k3_ops(explained.graphs)
    # each AttnRes mix (layer 0 has only the MLP-side one) is one node; SiTU-GLU is the
    # reference's elementwise chain on CPU (inductor fuses it), our kernel on CUDA; the KDA
    # reference's chunk math is one node (its loops are not unrolled into the graph), and so is
    # each of the three short convs (oneDNN's depthwise convolution on CPU)
    glue = {"k3.attnres_mix.default": 1 if LAYERS[name] == 0 else 2}
    if name.startswith("kda"):
        glue.update({"k3.kda_chunk.default": 1, "k3.short_conv.default": 3})
    if name.endswith("moe"):  # three expert GEMMs, the router statistics: one node each
        glue.update({"k3.grouped_mm.default": 3, "k3.record_router_stats.default": 1})
    assert ops == glue, ops


@pytest.mark.parametrize("name", LAYERS)
def test_layer_is_one_graph_forced_cuda_backends(setup, name):
    layer, prefix, blocks, cu, shape = _layer(setup, name)
    packing = _fresh(cu, shape)  # validated on the host, as the trainer does
    torch._dynamo.reset()
    with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        explained = torch._dynamo.explain(layer)(
            fake.from_tensor(prefix).requires_grad_(), fake.from_tensor(blocks), packing)
    _assert_one_graph(explained, f"{name} (CUDA backends)")
    ops = _k3_ops(explained.graphs)
    attention = {"kda": "k3.chunk_kda_fla.default", "mla": "k3.varlen_attention.default"}
    assert ops[attention[name[:3]]] == 1, ops
    assert ops["k3.attnres_mix.default"] == (1 if LAYERS[name] == 0 else 2), ops
    assert ops["k3.situ_glu.default"] == (2 if name.endswith("moe") else 1), ops
    assert ops.get("k3.short_conv.default", 0) == (3 if name.startswith("kda") else 0), ops
    if name.endswith("moe"):
        assert ops["k3.grouped_mm.default"] == 3 and ops["k3.record_router_stats.default"] == 1


@pytest.mark.parametrize("forced", [False, True])
def test_layer_with_fused_grad_accumulation_is_one_graph(setup, forced):
    """With `main_grad` buffers attached (`parallel.grad_accumulation`), each layer type is
    still one graph, CPU and CUDA backends: the fused-gradient GEMMs are autograd functions
    dynamo traces, not breaks."""
    model, cu, shape, inputs = setup
    for name, idx in LAYERS.items():
        layer = type(model.layers[str(idx)])(model.config, idx)
        layer.load_state_dict(model.layers[str(idx)].state_dict())
        layer.train()
        assert attach_local_main_grads(layer)
        prefix, blocks = inputs[idx]
        packing = _fresh(cu, shape)
        torch._dynamo.reset()
        if forced:
            with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
                explained = torch._dynamo.explain(layer)(
                    fake.from_tensor(prefix).requires_grad_(), fake.from_tensor(blocks),
                    packing)
        else:
            explained = torch._dynamo.explain(layer)(
                prefix.detach().clone().requires_grad_(), blocks, packing)
        _assert_one_graph(explained, f"{name} (fused accumulation, forced={forced})")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_layer_is_one_graph(setup, mode):
    model, cu, shape, inputs = setup
    for name in ("kda_moe", "mla_moe"):  # the dense layer's parts are in these two
        idx = LAYERS[name]
        layer = type(model.layers[str(idx)])(model.config, idx)
        layer.load_state_dict(model.layers[str(idx)].state_dict())
        layer.train()
        apply_activation_checkpointing([layer], mode)
        prefix, blocks = inputs[idx]
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(
            prefix.detach().clone().requires_grad_(), blocks, _fresh(cu, shape))
        _assert_one_graph(explained, f"{name} ({mode} checkpointing)")
        assert _k3_ops(explained.graphs)["k3.record_router_stats.default"] == 1


def _step(layer, prefix, blocks, packing):
    prefix = prefix.detach().clone().requires_grad_()
    out, new_blocks = layer(prefix, blocks, packing)
    (out.square().mean() + new_blocks.mean()).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    stats = [b.clone() for n, b in layer.named_buffers()
             if n.endswith(("qb_counts", "expert_load"))]
    return out.detach(), prefix.grad, grads, stats


@pytest.mark.parametrize(("name", "checkpoint"), [("kda_moe", "full"), ("mla_moe", "selective")])
def test_compiled_layer_equals_eager(setup, name, checkpoint):
    """fullgraph compile (aot_eager) of one checkpointed layer: same output, gradients and
    router counts as eager (the whole model compiled without checkpointing, every layer type,
    is `tests/unit/test_ac_compile.py::test_compile_equals_eager_fp32`)."""
    model, cu, shape, inputs = setup
    idx = LAYERS[name]
    results = []
    for compiled in (False, True):
        layer = type(model.layers[str(idx)])(model.config, idx)
        layer.load_state_dict(model.layers[str(idx)].state_dict())
        layer.train()
        apply_activation_checkpointing([layer], checkpoint)
        if compiled:
            torch._dynamo.reset()
            layer.forward = torch.compile(layer.forward, backend="aot_eager", fullgraph=True)
        results.append(_step(layer, *inputs[idx], _fresh(cu, shape)))
    (out, dx, grads, stats), (c_out, c_dx, c_grads, c_stats) = results
    torch.testing.assert_close(c_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_dx, dx, rtol=1e-4, atol=1e-6)
    assert c_grads.keys() == grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(c_grads[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")
    assert len(stats) == (2 if name.endswith("moe") else 0)
    for c, ref in zip(c_stats, stats, strict=True):  # counted once, recomputed or not
        assert torch.equal(c, ref) and int(ref.sum()) > 0


def test_apply_compile_compiles_every_layer():
    """Layers share `DecoderLayer.forward`'s code object; with more distinct layers than
    dynamo's default recompile limit (8: here each layer gets another number of AttnRes blocks)
    every one still gets its graph instead of running eagerly past the limit."""
    from torch._dynamo.utils import counters

    n = 9
    model = tiny_model(num_hidden_layers=n, full_attn_layers=list(range(1, n + 1)),
                       first_k_dense_replace=n, attn_res_block_size=1)  # MLA + dense MLP
    model.train()
    apply_compile(list(model.layers.values()), backend="eager")
    torch._dynamo.reset()
    counters.clear()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        model(ids, labels=ids)
    assert counters["stats"]["unique_graphs"] == n, dict(counters["stats"])
    assert counters["frames"]["ok"] == counters["frames"]["total"] == n, dict(counters["frames"])


def test_debug_config_has_the_layer_types():
    cfg = debug_config()
    assert [cfg.layer_type(i) for i in LAYERS.values()] == ["kda", "kda", "mla"]
    assert [cfg.is_moe_layer(i) for i in LAYERS.values()] == [False, True, True]


def test_mtp_layer_is_one_graph():
    """The MTP module's decoder layer (no AttnRes state: a plain residual layer) is one graph
    too, with no AttnRes mix in it."""
    model = tiny_model(num_nextn_predict_layers=1)
    model.train()
    ids, _, cu = packed_batch(batch=2, seq=64)
    x = torch.randn(*ids.shape, model.config.hidden_size, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.mtp.layer)(x, x.new_zeros((0, *x.shape)),
                                                       _fresh(cu, ids.shape))
    _assert_one_graph(explained, "mtp")
    ops = _k3_ops(explained.graphs)
    assert "k3.attnres_mix.default" not in ops and ops["k3.grouped_mm.default"] == 3, ops

"""GPU-ready means fake-traceable and sync-free (ARCHITECTURE.md principle 6).

(a) Under `FakeTensorMode` (CPU-device fake tensors: a CPU-only torch build aborts on autograd
over fake CUDA tensors), with every backend forced to its CUDA choice (fla KDA, varlen
attention, `_grouped_mm`: their custom ops' fake implementations stand in), these trace with no
DataDependentOutputException / DynamicOutputShapeException, i.e. no op that would make a GPU
wait for the host: a packed-document forward+backward of `debug` (also with MTP), one
`forward_stage` of a pipeline stage, and forward+backward of one decoder layer of each type of
the full `k3` preset at real width (4096 tokens, bf16).
(b) In a real CPU step the host-sync counter (`train.observe.host_syncs`) sees nothing inside the
model's forward and backward; the whole-step figures are checked in `tests/e2e/test_pretrain.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from model.config import load_model_config
from model.decoder import DecoderLayer, K3Model
from model.ops.backends import force_cuda_backends
from model.packing import Packing
from tests.helpers.tiny import debug_config, packed_batch, tiny_model
from train.observe.host_syncs import HostSyncCounter


def _doc_bounds(batch: int, seq: int, docs_per_row: int) -> list[int]:
    """cu_seqlens of `docs_per_row` uneven documents in each row (the first one shorter)."""
    step = seq // docs_per_row
    starts = [0, *(i * step - 3 for i in range(1, docs_per_row))]
    return [r * seq + s for r in range(batch) for s in starts] + [batch * seq]


def _fake_packing(batch: int, seq: int, docs_per_row: int) -> Packing:
    cu = torch.tensor(_doc_bounds(batch, seq, docs_per_row), dtype=torch.int32)
    return Packing(batch, seq, "cpu", cu, max_seqlen=seq)


@pytest.mark.parametrize("forced,mtp", [(True, 0), (False, 0), (True, 1)],
                         ids=["cuda_backends", "cpu_backends", "mtp_cuda_backends"])
def test_debug_packed_step_traces_under_fake_tensors(forced, mtp):
    cfg = debug_config(num_nextn_predict_layers=mtp)
    model = K3Model(cfg, device="meta")
    with force_cuda_backends(forced), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        model.train()
        ids = torch.zeros(2, 64, dtype=torch.long)
        labels = torch.zeros(2, 64, dtype=torch.long)
        loss, n = model(ids, _fake_packing(2, 64, 3), labels=labels)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads[:5]) and loss.shape == ()


def test_pipeline_stage_traces_under_fake_tensors():
    cfg = debug_config()
    model = K3Model(cfg, device="meta")
    with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        d, B, T = cfg.hidden_size, 2, 64
        prefix = torch.randn(B, T, d, requires_grad=True)
        blocks = torch.randn(1, B, T, d, requires_grad=True)  # a stage starting at layer 3
        cu = torch.tensor(_doc_bounds(B, T, 3) + [B * T] * 2, dtype=torch.int32)  # padded row
        out = model.forward_stage(prefix, blocks, cu_seqlens=cu.view(1, -1), seq_len=T,
                                  max_seqlen=T, labels=torch.zeros(B, T, dtype=torch.long),
                                  layer_ids=["3", "4", "5"])
        (out[0].sum() + out[1].sum()).backward()
    assert out[1].shape == (2, B, T, d) and prefix.grad is not None


def _k3_layer_step(idx: int) -> tuple[str, bool]:
    cfg = load_model_config("k3")
    B, T = 1, 4096
    layer = DecoderLayer(cfg, idx, device="meta").to(torch.bfloat16)
    with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True):
        layer.to_empty(device="cpu")
        layer.train()
        n = -(-idx // cfg.attn_res_block_size)
        prefix = torch.randn(B, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        blocks = torch.randn(n, B, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        out, _ = layer(prefix, blocks, _fake_packing(B, T, 4))
        out.float().sum().backward()
        return f"{layer.layer_type}+{type(layer.ffn).__name__}", prefix.grad is not None


@pytest.mark.parametrize("idx", [0, 1, 3], ids=["kda_dense", "kda_moe", "mla_moe"])
def test_full_k3_layer_traces_under_fake_tensors(idx):
    kind, has_grad = _k3_layer_step(idx)
    assert kind == {0: "kda+SiTUMLP", 1: "kda+LatentMoE", 3: "mla+LatentMoE"}[idx]
    assert has_grad


def test_no_host_sync_inside_the_model_on_cpu():
    """A real packed forward+backward (training mode: routing, Quantile-Balancing histograms,
    expert loads, grouped GEMMs, chunked loss) reads nothing back on the host."""
    model = tiny_model()
    model.train()
    ids, labels, cu = packed_batch(batch=2, seq=64)
    packing = Packing.from_host(cu, *ids.shape, ids.device)  # validated here, outside
    with HostSyncCounter() as counter:
        loss, n = model(ids, packing, labels=labels)
        loss.backward()
    assert counter.counts == {}, counter.counts
    assert loss.isfinite() and model.layers["1"].block_sparse_moe.gate.expert_load.sum() > 0


def test_counter_sees_the_syncs_it_must():
    """The counter is not blind: the old ways (bincount, nonzero, item, boolean masks) count."""
    x = torch.arange(10)
    with HostSyncCounter() as counter:
        torch.bincount(x)
        torch.nonzero(x)
        x[x > 3]
        x.sum().item()
        int(x[0])
    assert counter.counts == {"aten.bincount": 1, "aten.nonzero": 1, "aten.index": 1,
                              "Tensor.item": 1, "Tensor.__int__": 1}


def test_fp64_reference_path_is_listed_as_syncing():
    """float64 verification runs take the padded-bmm reference (listed in HOST_SYNC_OPS)."""
    from model.ops import HOST_SYNC_OPS

    model = tiny_model(dtype=torch.float64)
    ids, labels, cu = packed_batch(batch=1, seq=64)
    packing = Packing.from_host(cu, *ids.shape, ids.device)
    with HostSyncCounter() as counter:
        model(ids, packing, labels=labels)[0].backward()
    assert set(counter.counts) == {"Tensor.item"}  # one per grouped GEMM, nothing else
    assert "grouped_gemm._padded_bmm" in HOST_SYNC_OPS

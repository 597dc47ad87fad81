"""The analytic activation-memory model (`parallel.activation_memory`) against fake-tensor
traces of the same step (`tests/helpers/memory_trace.py`): full `k3` width (5 layers with every
layer kind, AttnRes blocks of 2 so three block starts, MTP with its h_proj), bf16, CUDA
backends; every checkpointing mode; up to 64K tokens; tensor and context parallelism on a fake
process group. The issue's bound is 10%; the model should in fact be within 1%, and a
missing or doubled term of any layer moves it by more than that."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from model.config import load_model_config
from parallel.activation_memory import Shard, micro_batches_in_flight, stage_memory

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 5


def _config():
    return dataclasses.replace(load_model_config("k3"), num_hidden_layers=LAYERS,
                               full_attn_layers=[4], attn_res_block_size=2,
                               num_nextn_predict_layers=1, mtp_attn_res_blocks=[1, 2])


def _ratio(shard: Shard, ac: str, traced: int) -> float:
    return stage_memory(_config(), shard, list(range(LAYERS)), ac).kept / traced


@pytest.mark.parametrize("batch,seq,ac", [(1, 65536, "none"), (2, 16384, "full"),
                                          (2, 16384, "selective")])
def test_one_rank_matches_the_trace(batch, seq, ac):
    from tests.helpers.memory_trace import trace_step

    traced = trace_step(_config(), batch, seq, ac).saved_bytes
    assert traced > (2**30 if ac == "full" else 50 * 2**30)  # the trace sees the step
    assert abs(_ratio(Shard(tokens=batch * seq, batch=batch), ac, traced) - 1) < 0.01


_PARALLEL = """
import dataclasses, json, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from parallel.context_parallel import apply_context_parallel
from parallel.tensor_parallel import apply_tensor_parallel
from tests.helpers.memory_trace import trace_step
from tests.unit.test_activation_memory import _config

out = {}
for tp, cp in json.loads(sys.argv[1]):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp)
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))

    def prepare(model):
        if tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        if cp > 1:
            apply_context_parallel(model, mesh["cp"], "gloo")

    out[f"{tp},{cp}"] = trace_step(_config(), 1, 8192, prepare=prepare).saved_bytes
    dist.destroy_process_group()
print(json.dumps(out))
"""

_LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def parallel_traces() -> dict[str, int]:
    """Saved bytes of rank 0 under each (tp, cp), traced in one process on fake groups."""
    run = subprocess.run([sys.executable, "-c", _PARALLEL, json.dumps(_LAYOUTS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("tp,cp", _LAYOUTS, ids=["tp2", "cp2", "tp2_cp2"])
def test_tensor_and_context_parallel_match_the_trace(parallel_traces, tp, cp):
    """Tokens per rank S = T / cp and s = S / tp, heads / tp, Ulysses' v without k_C, and KCP's
    widened v and per-document states (the trace's rows hold 4 documents)."""
    traced = parallel_traces[f"{tp},{cp}"]
    shard = Shard(tokens=8192 // cp, docs=4, tp=tp, cp=cp)
    assert abs(_ratio(shard, "none", traced) - 1) < 0.01
    if cp > 1:  # without the KCP terms the model would be short
        bare = stage_memory(_config(), dataclasses.replace(shard, cp=1), list(range(LAYERS)))
        assert traced - bare.kept > 0.01 * traced


def test_micro_batches_in_flight_follow_the_schedules():
    """1F1B: pp - rank; GPipe: all; interleaved: torch's warm-up count plus one, in stage
    chunks of 1/v of the rank's layers (torch.distributed.pipelining's own formula)."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    assert [micro_batches_in_flight("1F1B", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert micro_batches_in_flight("1F1B", 4, 0, 2) == 2
    assert micro_batches_in_flight("GPipe", 4, 3, 8) == 8
    assert micro_batches_in_flight(None, 1, 0, 8) == 1
    for schedule, factor in (("Interleaved1F1B", 2), ("InterleavedZeroBubble", 1)):
        for rank in range(4):
            chunks = min(8 * 2, _get_warmup_ops(rank, 2, 4, 4, 8, multiply_factor=factor) + 1)
            assert micro_batches_in_flight(schedule, 4, rank, 8, 2) == chunks / 2

"""GPU suite stage ops (benchmarks/gpu/i_ops.py) on CPU: the roofline's replay specs, the
arguments rebuilt from them (layouts as traced, index values in range, document bounds, grouped
GEMM offsets), every distinct call of a debug step replayed on meta and the top ones timed, and
`collect.py table` over the stage's line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import collect  # noqa: E402
import gpu_common  # noqa: E402
import i_ops  # noqa: E402
import op_replay  # noqa: E402

roofline = i_ops.roofline  # the module op_replay's spec classes come from
aten = torch.ops.aten


def _records(fn, replay: bool = True):
    return roofline.trace_ops(fn, replay=replay)


def _replay_of(records, op):
    return next(r.replay for r in records if r.replay is not None and r.replay.op == op)


def test_records_carry_overload_and_layouts_and_keep_their_numbers():
    def fn():
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        w = torch.randn(32, 16, dtype=torch.bfloat16)
        table = torch.randn(50, 16)
        ids = torch.zeros(8, dtype=torch.long)
        y = x @ w.t()  # mm with a transposed (strided) weight
        e = torch.nn.functional.embedding(ids, table)
        return y.float().sum() + e.to(torch.device("cpu")).sum()

    with_spec, plain = _records(fn), _records(fn, replay=False)
    assert all(r.replay is None for r in plain)
    assert [(r.name, r.time(roofline.GPUS["h200"])) for r in with_spec] == \
        [(r.name, r.time(roofline.GPUS["h200"])) for r in plain]
    mm = _replay_of(with_spec, aten.mm.default)
    assert mm.why_not is None and mm.args[1] == roofline.TensorSpec((16, 32), (1, 16),
                                                                    torch.bfloat16, False)
    emb = _replay_of(with_spec, aten.embedding.default)
    assert emb.args[1].dtype == torch.long
    assert op_replay.describe(mm) == "8x16 bf16, 16x32 bf16 strided"


def test_index_arguments_are_in_range_and_unknown_integer_ops_are_refused():
    def fn():
        src = torch.randn(6, 5)
        idx = torch.zeros(4, 5, dtype=torch.long)
        g = torch.gather(src, 1, idx)  # index < 5
        acc = torch.zeros(3, 5).index_put_((torch.zeros(7, dtype=torch.long),),
                                           torch.randn(7, 5), accumulate=True)  # index < 3
        counts = torch.zeros(9, dtype=torch.long).scatter_add_(
            0, torch.zeros(11, dtype=torch.long), torch.ones(11, dtype=torch.long))  # < 9
        took = torch.take(src, idx)  # an index op without a rule: refused, not guessed
        return g, acc, counts, took

    recs = _records(fn)
    for op, arg, pos, high in ((aten.gather.default, 2, None, 5),
                               (aten.index_put_.default, 1, 0, 3),
                               (aten.scatter_add_.default, 2, None, 9)):
        rp = _replay_of(recs, op)
        for _ in range(5):
            args, _ = op_replay.build(rp, torch.device("cpu"), [0, 4])
            index = args[arg] if pos is None else args[arg][pos]
            assert 0 <= int(index.min()) and int(index.max()) < high, op
            rp.op(*args)
    with pytest.raises(op_replay.NotReplayable, match="no values known to be safe"):
        op_replay.build(_replay_of(recs, aten.take.default), torch.device("cpu"), [0, 4])


def test_document_bounds_and_grouped_gemm_offsets():
    import model.ops.grouped_gemm  # noqa: F401 - registers k3::grouped_mm

    with FakeTensorMode():
        x = torch.randn(10, 8, dtype=torch.bfloat16)  # rows of 16 bytes: _grouped_mm's rule
        w = torch.randn(3, 16, 8, dtype=torch.bfloat16)
        offs = torch.zeros(3, dtype=torch.int32)
    rp = roofline.replay_spec(torch.ops.k3.grouped_mm.default, (x, w, offs), {})
    args, _ = op_replay.build(rp, torch.device("cpu"), [0, 10])
    assert args[2].tolist() == [3, 7, 10] and args[2].dtype == torch.int32
    assert rp.op(*args).shape == (10, 16)
    import model.ops.wgrad  # noqa: F401 - registers k3::grouped_wgrad_accumulate

    with FakeTensorMode():  # the fused weight gradient: offsets over dy's rows, not main_grad's
        main = torch.zeros(3, 16, 8)
        dy = torch.randn(10, 16, dtype=torch.bfloat16)
    rp = roofline.replay_spec(torch.ops.k3.grouped_wgrad_accumulate.default,
                              (main, dy, x, offs), {})
    args, _ = op_replay.build(rp, torch.device("cpu"), [0, 10])
    assert args[3].tolist() == [3, 7, 10]
    rp.op(*args)
    spec = roofline.TensorSpec((3,), (1,), torch.int32, True)
    b = op_replay._Builder(rp, torch.device("cpu"), [0, 4, 9])
    assert b.tensor("cu_seqlens", spec, None).tolist() == [0, 4, 9]
    with pytest.raises(op_replay.NotReplayable, match="traced 1 documents"):
        op_replay._Builder(rp, torch.device("cpu"), [0, 9]).tensor("cu_seqlens", spec, None)


@pytest.fixture(scope="module")
def debug_trace():
    return roofline.analyze(i_ops.SMALL, "h200", world=1, replay=True)


def test_every_distinct_call_of_a_debug_step_replays_on_meta(debug_trace):
    """The whole replay path at no cost: every group's arguments built on the meta device and
    its op run there (k3 custom ops through their fake implementations)."""
    summary, records = debug_trace
    groups = i_ops.group_records(records, roofline.GPUS["h200"])
    assert sum(g.count for g in groups) == len(records)
    assert sum(g.total_s for g in groups) == pytest.approx(summary["predicted_step_s"])
    bounds = [0]
    for n in summary["doc_lengths"]:
        bounds.append(bounds[-1] + n)
    meta, refused = torch.device("meta"), []
    for g in groups:
        if g.why_not is not None:
            assert g.name.startswith("fsdp.")
            continue
        try:
            with torch.no_grad():
                args, kwargs = op_replay.build(g.replay, meta, bounds)
                g.replay.op(*args, **kwargs)
        except op_replay.NotReplayable as e:
            refused.append(f"{g.replay.op}: {e}")
    assert refused == []


def test_stage_runs_on_cpu_and_collect_makes_its_table(debug_trace, monkeypatch, tmp_path):
    monkeypatch.setattr(i_ops.roofline, "analyze", lambda *a, **k: debug_trace)
    args = argparse.Namespace(device="cpu", small=True, budget=60.0, top=6)
    out: dict = {"stage": "ops"}
    assert i_ops.main(gpu_common.Ctx(args), out)
    assert out["attempted"] == out["measured"] == 6 == len(out["ops"])
    t = out["totals"]
    assert t["predicted_ms"] == pytest.approx(
        sum(r["predicted_us"] * r["count"] for r in out["ops"]) / 1e3)
    assert 0 < t["share_of_predicted_step"] < 1
    assert all(r["measured_us"] > 0 and r["ratio"] > 0 for r in out["ops"])
    results = tmp_path / "gpu_suite.jsonl"
    step = {"stage": "step", "tokens_per_sec_from": "step 2 (timed)",
            "steps": [{"step": 1, "step_s": 9.0}, {"step": 2, "step_s": 0.5,
                                                    "train_step_s": 0.4}],
            "config": {"seq_len": 128, "global_batch": 1}}
    results.write_text(json.dumps(gpu_common._clean(out)) + "\n" + json.dumps(step) + "\n")
    md = collect.table(str(results))
    assert md.count("\n| `") == 6 and "sum of the 6 measured" in md  # aten.* and k3.* rows
    ratio = 0.5 / out["predicted_step_s"]
    assert "stage step 0.500 s (step 2 (timed), 128 tokens" in md and f"{ratio:.2f}." in md


def test_collect_passed_gates_the_fused_fallback(tmp_path):
    """gpu_suite.sh runs the later stages on the PyTorch paths unless stage fused passed."""
    results = tmp_path / "r.jsonl"
    results.write_text('{"stage": "fused", "ok": true, "within_tol": false}\n')
    assert not collect.passed(str(results), "fused", "within_tol")
    results.write_text('{"stage": "fused", "ok": true, "within_tol": true}\n')
    assert collect.passed(str(results), "fused", "within_tol")
    assert not collect.passed(str(tmp_path / "missing.jsonl"), "fused", "within_tol")
    results.write_text('{"stage": "fused", "ok": false, "skipped": "suite budget"}\n')
    assert not collect.passed(str(results), "fused", "within_tol")

"""benchmarks/train_step_cpu.py's GEMM-ceiling accounting: the BLAS FLOPs it reads from the
profiler's recorded shapes equal torch.utils.flop_counter's count of the same calls (plus the
in-place addmm_, which the counter has no formula for), and the triangular solve counts n^2 r
per batch, by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_step_cpu",
                                               ROOT / "benchmarks" / "train_step_cpu.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["train_step_cpu"] = bench
_spec.loader.exec_module(bench)


def _products() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g), torch.randn(5, 7, generator=g)
    x, y = torch.randn(3, 4, 5, generator=g), torch.randn(3, 5, 2, generator=g)
    torch.mm(a, b)
    torch.addmm(torch.randn(7, generator=g), a, b)
    torch.bmm(x, y)
    torch.baddbmm(torch.randn(3, 4, 2, generator=g), x, y)
    torch.randn(6, 7, generator=g).addmm_(a, b)


def test_blas_flops_from_profiled_shapes_match_the_flop_counter():
    with FlopCounterMode(display=False) as fc:
        _products()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _products()
    got = bench.profiled_blas_flops(prof.events())
    assert got == 2 * (3 * 6 * 5 * 7 + 2 * 3 * 4 * 5 * 2)  # mm, addmm, addmm_; bmm, baddbmm
    assert fc.get_total_flops() == got - 2 * 6 * 5 * 7  # all but addmm_


def test_triangular_solve_counts_n_squared_r_per_batch():
    A = torch.eye(4).expand(2, 3, 4, 4).tril()
    B = torch.randn(2, 3, 4, 6)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.linalg.solve_triangular(A, B, upper=False)
    calls = [e for e in prof.events() if e.name == "aten::linalg_solve_triangular"]
    assert len(calls) == 1
    assert bench._blas_flops(calls[0].name, calls[0].input_shapes) == 2 * 3 * 4 * 4 * 6

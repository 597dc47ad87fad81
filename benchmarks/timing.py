"""The benchmarks' one timing rule: a warm-up call, then the best of `repeats` calls."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest of `repeats` calls of `fn` after one warm-up, on `clock` (wall time by default;
    `time.process_time` for CPU seconds summed over threads)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best

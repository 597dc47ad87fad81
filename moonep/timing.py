"""Intervals spent in moonep's collectives, for callers that measure a rank's own compute.

Under synchronous collectives every rank's wall-clock step is the same, so a slow rank shows only
as the others' waiting: a caller (k3train's straggler detector) times its layers and subtracts
the time moonep spent in `all_gather` / `all_to_all` (waiting for the other ranks included).
Nothing is timed unless an `IntervalClock` is watching (`watch`); then each collective records
a (start, end) pair of marks: `time.perf_counter()` floats on CPU, recorded CUDA events on CUDA,
read only after the caller's own end-of-step synchronisation (`IntervalClock.seconds`).
"""

from __future__ import annotations

import time

import torch

_watching: list[IntervalClock] = []


class IntervalClock:
    """Collects (start, end) marks on one device and sums them on request."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple] = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self) -> float:
        """Total of the recorded intervals (CUDA: after the work is synchronised); clears."""
        if self.cuda:
            total = sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        else:
            total = sum(b - a for a, b in self.pairs)
        self.pairs.clear()
        return total


def watch(clock: IntervalClock) -> None:
    _watching.append(clock)


def unwatch(clock: IntervalClock) -> None:
    _watching.remove(clock)


def collective_start() -> list | None:
    """Marks of every watching clock before a collective (None, at no cost, if none)."""
    return [c.mark() for c in _watching] if _watching else None


def collective_end(starts: list | None) -> None:
    if starts is not None:
        for clock, start in zip(_watching, starts):
            clock.pairs.append((start, clock.mark()))

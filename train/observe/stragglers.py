"""Straggler detection: each rank's own compute time per step, and the rank that is slow.

Under synchronous collectives every rank's wall-clock step time is the same (the fast ranks wait
for the slow one), so the time is taken where a rank computes: inside its decoder layers'
forwards (and their recomputation under activation checkpointing), entered after FSDP's
all-gather (our hooks run after FSDP's pre-forward hook), minus moonep's expert-parallel
collectives inside them (`moonep.timing`). Marks are `perf_counter` on CPU and CUDA events on
CUDA, read after the step's own synchronisation. One small all-reduce per step gathers every
rank's seconds (with its pipeline stage: ranks of different stages do different work, so a rank
is compared with the median of the other ranks of its stage, or of all ranks under no
pipeline). `train.straggler_factor` times that median for `train.straggler_steps` steps in a
row names the rank in a warning. Not counted: the backward (it scales with the forward on the
same device), and waits inside tensor-parallel layers (a slow rank slows its whole TP group).

`debug.slow_rank` / `debug.slow_rank_s`: test-only, that rank sleeps this long in its first
layer's forward each micro-batch (a slow device, as the detector sees one).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from moonep import timing


class ComputeClock:
    """Hooks on a model's decoder layers that sum this rank's compute seconds per step."""

    def __init__(self, model: nn.Module, device: torch.device, slow_s: float = 0.0) -> None:
        self.device, self.slow_s = device, slow_s
        self.layers = timing.IntervalClock(device)
        self.comm = timing.IntervalClock(device)
        self._open: dict[int, object] = {}
        self._handles = []
        layers = model.decoder_layers()
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter(i, i == 0)))
            self._handles.append(layer.register_forward_hook(self._leave(i)))
        timing.watch(self.comm)

    def _enter(self, i: int, first: bool):
        def hook(module, args):
            self._open[i] = self.layers.mark()
            if first and self.slow_s:
                _sleep(self.slow_s, self.device)
        return hook

    def _leave(self, i: int):
        def hook(module, args, out):
            start = self._open.pop(i, None)
            if start is not None:
                self.layers.pairs.append((start, self.layers.mark()))
        return hook

    def reset(self) -> None:
        """Forget forwards outside the step (diagnostic images, validation)."""
        self.layers.pairs.clear()
        self.comm.pairs.clear()
        self._open.clear()

    def step_seconds(self) -> float:
        """This step's compute seconds (after the step's synchronisation); resets."""
        return max(0.0, self.layers.seconds() - self.comm.seconds())

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        timing.unwatch(self.comm)


def _sleep(seconds: float, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda._sleep(int(seconds * 1.5e9))  # ~cycles at the SM clock
    else:
        time.sleep(seconds)


def gather_seconds(seconds: float, stage: int, rank: int, world: int,
                   device: torch.device) -> tuple[list[float], list[int]]:
    """Every rank's (compute seconds, pipeline stage), in one all-reduce."""
    t = torch.zeros(2, world, dtype=torch.float64, device=device)
    t[0, rank], t[1, rank] = seconds, stage
    dist.all_reduce(t)
    rows = t.tolist()
    return rows[0], [int(s) for s in rows[1]]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class StragglerDetector:
    """Names a rank whose compute time stays above `factor` x its peers' median."""

    def __init__(self, factor: float, steps: int, is_main: bool) -> None:
        self.factor, self.steps, self.is_main = factor, steps, is_main
        self.streak: dict[int, int] = {}
        self.warned: list[tuple[int, int]] = []  # (step, rank) of every warning

    def update(self, step: int, seconds: list[float], stages: list[int]) -> dict:
        """Metrics of this step; warns (main rank) when a rank's streak reaches `steps`."""
        slowest = max(range(len(seconds)), key=seconds.__getitem__)
        out = {"step_compute_max_s": seconds[slowest], "step_compute_median_s": _median(seconds),
               "step_compute_slowest_rank": slowest}
        if not self.factor or len(seconds) < 2:
            return out
        for r, s in enumerate(seconds):
            peers = [x for q, x in enumerate(seconds) if q != r and stages[q] == stages[r]]
            peers = peers or [x for q, x in enumerate(seconds) if q != r]
            ref = _median(peers)
            slow = ref > 0 and s > self.factor * ref
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            if slow and self.streak[r] == self.steps:
                self.warned.append((step, r))
                if self.is_main:
                    print(f"warning: rank {r} is a straggler: its compute took {s:.3f} s at "
                          f"step {step}, {s / ref:.1f}x its peers' median {ref:.3f} s, for "
                          f"{self.steps} steps in a row (train.straggler_factor={self.factor:g});"
                          " check that rank's device and host", flush=True)
        return out

"""Test-only process faults (`K3TRAIN_FAULT`): kill -9 of a rank at a chosen point, or a failed
checkpoint write, so the restart and integrity paths are exercised the way a node failure or a
full disk would reach them.

`K3TRAIN_FAULT` is a comma-separated list of `<point>:<step>[:<rank>][@<attempt>]`:
- `forward` / `backward`: SIGKILL inside the step's forward (entering the last decoder layer the
  rank holds) or backward (when the gradient reaches the first one's input);
- `before_publish`: after a synchronous save's shards are written, before it is published;
- `async_write`: inside an asynchronous save's background write;
- `enospc`: the save's shard write fails with ENOSPC (the rank defaults to the last one);
- `random:<seed>`: SIGKILL at a seeded random moment 0.5-4 s into the attempt's training loop.
`<rank>` defaults to every rank (the last one for `enospc`); `<attempt>` is torchrun's restart
count (`TORCHELASTIC_RESTART_COUNT`), default 0, so a restarted job does not fail again the same
way. With `K3TRAIN_FAULT_LOG=<file>` every kill, and every launcher start, appends a JSON line
`{event, rank, attempt, time}` (the restart tests time the recovery from it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator

from torch import nn

POINTS = ("forward", "backward", "before_publish", "async_write", "enospc", "random")


def attempt() -> int:
    """torchrun's restart count of this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _faults() -> list[dict]:
    out = []
    for item in filter(None, os.environ.get("K3TRAIN_FAULT", "").split(",")):
        spec, _, at = item.partition("@")
        point, step, *rank = spec.split(":")
        if point not in POINTS or len(rank) > 1:
            raise ValueError(f"K3TRAIN_FAULT entry {item!r}: use <point>:<step>[:<rank>]"
                             f"[@<attempt>] with a point of {POINTS}")
        default = _world() - 1 if point == "enospc" else None
        out.append({"point": point, "step": int(step),
                    "rank": int(rank[0]) if rank else default, "attempt": int(at or 0)})
    return out


def armed(point: str, step: int | None = None) -> dict | None:
    """The fault entry for `point` (at `step`, if given) on this rank and attempt, if any."""
    for f in _faults():
        if (f["point"] == point and (step is None or f["step"] == step)
                and f["rank"] in (None, _rank()) and f["attempt"] == attempt()):
            return f
    return None


def record(event: str, **fields) -> None:
    """Append `{event, rank, attempt, time, ...}` to $K3TRAIN_FAULT_LOG (if set)."""
    path = os.environ.get("K3TRAIN_FAULT_LOG")
    if path:
        line = {"event": event, "rank": _rank(), "attempt": attempt(), "time": time.time(),
                **fields}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())


def kill(point: str, step: int) -> None:
    """SIGKILL this process (as a node failure would), after recording it."""
    record("kill", point=point, step=step)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_point(point: str, step: int) -> None:
    """Kill here if `point` is armed at `step` for this rank and attempt."""
    if armed(point, step):
        kill(point, step)


@contextlib.contextmanager
def step_kill_hooks(model: nn.Module, step: int) -> Iterator[None]:
    """While active: the `forward` / `backward` faults armed at `step` on this rank."""
    layers = model.decoder_layers()
    handles = []
    if layers and armed("forward", step):
        handles.append(layers[-1].register_forward_pre_hook(
            lambda m, args: kill("forward", step)))
    if layers and armed("backward", step):
        def watch_input(module, args):
            if args[0].requires_grad:
                args[0].register_hook(lambda g: kill("backward", step))

        handles.append(layers[0].register_forward_pre_hook(watch_input))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def start_random_kill() -> None:
    """Arm the `random:<seed>` fault of this rank and attempt: a timer thread kills later."""
    f = armed("random")
    if f:
        delay = random.Random(f["step"]).uniform(0.5, 4.0)
        timer = threading.Timer(delay, kill, ("random", -1))
        timer.daemon = True
        timer.start()

"""Test-only fault injection (`debug.*`): non-finite values at chosen steps and ranks, so the
trainer's skip path (`train.trainer`: a non-finite loss or gradient norm on any rank skips
the step everywhere) is exercised the way a real NaN would reach it.

`debug.inject_nonfinite_steps=[3]`: a NaN loss on the last rank at step 3.
`debug.inject_nonfinite=[{step: 3, rank: 1, where: activation}]`: `loss` (the rank's loss
before backward), `activation` (the first decoder layer's input on the rank: the router and
everything after it see NaN) or `grad` (one gradient after backward: the loss stays finite).

`StepFaults.during(model, step)` is the loop's one entry: it arms this rank's injections of the
step (and `train.faults.crash`'s kill points) and yields the set that `train_step` applies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from train.faults import crash

WHERE = ("loss", "activation", "grad")


def _entries(debug, world_size: int) -> list[dict]:
    out = [{"step": s, "rank": world_size - 1, "where": "loss"}
           for s in debug.inject_nonfinite_steps]
    return out + [dict(e) for e in debug.inject_nonfinite]


def check_injections(debug, world_size: int) -> tuple[bool, str]:
    """(ok, the one-line error) for `validate_job`."""
    for e in _entries(debug, world_size):
        ok = (set(e) == {"step", "rank", "where"} and isinstance(e["step"], int)
              and e["step"] > 0 and isinstance(e["rank"], int)
              and 0 <= e["rank"] < world_size and e["where"] in WHERE)
        if not ok:
            return False, (f"debug.inject_nonfinite entry {e} must be {{step: >0, rank: "
                           f"0..{world_size - 1}, where: {'|'.join(WHERE)}}}")
    return True, ""


class Injections:
    """What to poison on this rank at each step."""

    def __init__(self, debug, rank: int, world_size: int) -> None:
        self.by_step: dict[int, set[str]] = {}
        for e in _entries(debug, world_size):
            if e["rank"] == rank:
                self.by_step.setdefault(e["step"], set()).add(e["where"])

    def at(self, step: int) -> set[str]:
        return self.by_step.get(step, set())


class StepFaults:
    """Every test-only fault of this rank; `K3TRAIN_FAULT`'s random kill is armed at creation."""

    def __init__(self, debug, rank: int, world_size: int) -> None:
        self.injections = Injections(debug, rank, world_size)
        crash.start_random_kill()

    @contextlib.contextmanager
    def during(self, model: nn.Module, step: int) -> Iterator[frozenset[str]]:
        """Around one training step: the poisoned activation and the kill hooks armed at
        `step`; yields the `train_step(faults=...)` set (loss, activation, grad)."""
        where = frozenset(self.injections.at(step))
        with poisoned_activation(model, "activation" in where), \
                crash.step_kill_hooks(model, step):
            yield where


@contextlib.contextmanager
def poisoned_activation(model: nn.Module, on: bool) -> Iterator[None]:
    """While active (if `on`), the first decoder layer this rank holds gets a NaN input."""
    layers = model.decoder_layers() if on else []
    if not layers:
        yield
        return

    def hook(module, args):
        return (args[0] * float("nan"), *args[1:])

    handle = layers[0].register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def poison_grad(model: nn.Module) -> None:
    """One gradient of this rank becomes NaN (its local shard)."""
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.view(-1)[:1].fill_(float("nan"))
            return


def poison_loss(loss: torch.Tensor, on: bool) -> torch.Tensor:
    return loss * float("nan") if on else loss

"""Sharded checkpoints of the whole train state with torch.distributed.checkpoint (DCP).

Layout: `<run>/checkpoints/step-<8 digits>/` holds the DCP shards of {model (with router biases
and QB statistics), optimizer} plus `train_state.json` (step, tokens seen, data-loader position,
scheduler, RNG states, model config). Each save is written to `.tmp-step-<n>/` and published by an
atomic rename once every rank has finished, so a crash (even kill -9) mid-write leaves the
previous checkpoint loadable and the partial one ignored. Loading goes through DCP's resharding,
so any world size or layout can load any other. On CUDA saves are asynchronous (their own gloo
group, cpu-testing.md trap 2) and published at the next save or at the end.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STEP_DIR = re.compile(r"^step-(\d{8})$")


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def rng_state() -> dict[str, Any]:
    # torch generators only: the model and the data loader draw from no other RNG
    state = {"torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        raw = base64.b64decode(state["cuda"])
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the crash tests: K3TRAIN_FAULT=<name>:<step> kills this process
    (SIGKILL, as a node failure would) when it reaches that point of that step's save."""
    if os.environ.get("K3TRAIN_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    def __init__(self, root: Path, keep: int, rank: int, async_save: bool = False) -> None:
        self.root, self.keep, self.rank = Path(root), keep, rank
        self.async_save = async_save and dist.is_initialized()
        self._pending: tuple[Any, Path, Path] | None = None
        self._async_group = dist.new_group(backend="gloo") if self.async_save else None

    # ------------------------------------------------------------------ discovery
    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for d in self.root.iterdir():
            m = STEP_DIR.match(d.name)
            if m and (d / ".metadata").is_file() and (d / "train_state.json").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.root / f"step-{steps[-1]:08d}" if steps else None

    # ----------------------------------------------------------------------- save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any]) -> None:
        self.wait()  # publish the previous asynchronous save first
        tmp = self.root / f".tmp-step-{step:08d}"
        final = self.root / f"step-{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_state())
        if self.rank == 0:
            payload = {**train_state, "rng": rngs, "world_size": dist.get_world_size()}
            (tmp / "train_state.json").write_text(json.dumps(payload))
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp),
                                    process_group=self._async_group)
            self._pending = (future, tmp, final)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            _fault_point("before_publish", step)
            self._publish(tmp, final)

    def wait(self) -> None:
        if self._pending is not None:
            future, tmp, final = self._pending
            future.result()
            self._pending = None
            self._publish(tmp, final)

    def _publish(self, tmp: Path, final: Path) -> None:
        dist.barrier()  # every rank's shards are on disk
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in self.complete_steps()[:-self.keep]:
                shutil.rmtree(self.root / f"step-{old:08d}", ignore_errors=True)
        dist.barrier()

    def clean_partial(self) -> None:
        """Remove `.tmp-*` leftovers of an interrupted save (rank 0; call before training)."""
        if self.rank == 0 and self.root.is_dir():
            for d in self.root.glob(".tmp-step-*"):
                shutil.rmtree(d, ignore_errors=True)
        dist.barrier()

    # ----------------------------------------------------------------------- load
    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
             ) -> dict[str, Any]:
        """Load model and optimizer (resharding as needed); return the train_state dict."""
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        set_optimizer_state_dict(model, optimizer, state["optim"])
        train_state = json.loads((path / "train_state.json").read_text())
        rngs = train_state.pop("rng")
        if train_state.pop("world_size") == dist.get_world_size():
            set_rng_state(rngs[self.rank])
        return train_state

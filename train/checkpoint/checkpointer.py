"""Sharded checkpoints of the whole train state with torch.distributed.checkpoint (DCP).

Layout: `<run>/checkpoints/step-<8 digits>/` holds the DCP shards of {model (with router biases and
QB statistics), optimizer} plus `train_state.json` (step, tokens seen, data-loader position,
scheduler, RNG states, model config); a model-only checkpoint (`save_weights`, written by
`train.checkpoint.import_hf` as step 0) holds the model alone. Each save is written to
`.tmp-step-<n>/` and published by an atomic rename once every rank has finished, so a crash (even
kill -9) mid-write leaves the previous checkpoint loadable and the partial one ignored. Loading goes
through DCP's resharding, so any world size or layout can load any other. Asynchronous saves
(`checkpoint.async_save`: on CUDA by default, on CPU when set) stage a copy of the state, write it
from a background thread on their own gloo group (cpu-testing.md trap 2) and are published at the
first step end at which every rank has finished writing (`poll`), at the latest at the next save or
the end.

Integrity: before publishing, `checksums.json` records the size and SHA-256 of every file of the
checkpoint (each rank hashes its share of the files). Resuming takes the newest checkpoint whose
files all match (`latest_intact`: each rank verifies a share, all agree); a missing, truncated or
altered file is named in one line and that checkpoint skipped for the previous one. A save that
fails (a full disk, an unwritable directory: `OSError` on any rank, which DCP raises on every rank)
removes its temporary directory, leaves the published ones as they were, says so, and training goes
on; the next interval tries again. DCP's `.metadata` is a pickle: load checkpoints from trusted
sources only."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from train.faults import crash as crash_faults

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


CHECKSUMS = "checksums.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_problem(path: Path, size: int, digest: str) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    found = path.stat().st_size
    if found != size:
        return f"{path.name} is truncated or overwritten ({size} bytes recorded, {found} found)"
    if _sha256(path) != digest:
        return f"{path.name} is corrupted (its SHA-256 differs from the recorded one)"
    return None


class _FullDisk(FileSystemWriter):
    """Fault injection (K3TRAIN_FAULT=enospc:<step>, `train.faults.crash`): this rank's shard
    write fails as on a full disk."""

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(self.path))


class _KilledWriter(FileSystemWriter):
    """Fault injection (K3TRAIN_FAULT=async_write:<step>): SIGKILL inside the (asynchronous)
    shard write."""

    def __init__(self, path: str, step: int) -> None:
        super().__init__(path)
        self.step = step

    def write_data(self, plan, planner):
        crash_faults.kill("async_write", self.step)


def _writer(tmp: Path, step: int):
    if crash_faults.armed("enospc", step):
        return _FullDisk(str(tmp))
    if crash_faults.armed("async_write", step):
        return _KilledWriter(str(tmp), step)
    return None


def root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (which wraps them)."""
    if isinstance(e, CheckpointException):
        for err in e.failures.values():
            inner = err[0] if isinstance(err, tuple) else err
            if isinstance(inner, BaseException):
                return root_cause(inner)
    return e


def _one_line(e: BaseException) -> str:
    """The root cause of a failed save, in one line."""
    cause = root_cause(e)
    text = str(cause).strip().splitlines()
    line = f"{type(cause).__name__}: {text[0] if text else ''}"
    return f"rank error: {line}" if cause is not e else line


def published_steps(root: Path) -> list[int]:
    """Steps of the `step-<8 digits>` directories under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for d in root.iterdir() if (m := STEP_DIR.match(d.name)))


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
        # polls whether every rank's background write is done (a CPU flag, no device sync)
        self._poll_group = dist.new_group(backend="gloo") if self.async_save else None

    # ------------------------------------------------------------------ discovery
    def complete_steps(self) -> list[int]:
        """Published steps holding .metadata and train_state.json (not verified)."""
        return [s for s in published_steps(self.root)
                if (self.root / f"step-{s:08d}" / ".metadata").is_file()
                and (self.root / f"step-{s:08d}" / "train_state.json").is_file()]

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.root / f"step-{steps[-1]:08d}" if steps else None

    def problem(self, path: Path) -> str | None:
        """What is wrong with checkpoint `path` (None: every recorded file matches), the same
        on every rank: each verifies a share of the files. One without checksums.json (from
        before they were recorded) only needs its .metadata and train_state.json."""
        record_path = path / CHECKSUMS
        found: str | None = None
        if not record_path.is_file():
            if not ((path / ".metadata").is_file() and (path / "train_state.json").is_file()):
                found = f"{CHECKSUMS}, .metadata or train_state.json is missing"
        else:
            try:
                record = json.loads(record_path.read_text())
            except ValueError:
                record, found = {}, f"{CHECKSUMS} is not valid JSON"
            world = dist.get_world_size() if dist.is_initialized() else 1
            for name in sorted(record)[self.rank::world]:
                found = found or _file_problem(path / name, record[name]["bytes"],
                                               record[name]["sha256"])
        if dist.is_initialized():
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, found)
            found = next((p for p in parts if p), None)
        return found

    def latest_intact(self, log=print) -> Path | None:
        """The newest published checkpoint whose files all match their checksums; each one
        skipped is named with its first problem (collective: every rank calls)."""
        for step in reversed(published_steps(self.root)):
            path = self.root / f"step-{step:08d}"
            problem = self.problem(path)
            if problem is None:
                return path
            if self.rank == 0:
                log(f"warning: checkpoint {path.name} is damaged ({problem}); skipping it")
        return None

    # ----------------------------------------------------------------------- save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any]) -> bool:
        """Save (or start saving) step `step`; False if it failed and was abandoned."""
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
        try:
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(tmp),
                                        storage_writer=_writer(tmp, step),
                                        process_group=self._async_group)
                self._pending = (future, tmp, final)
            else:
                dcp.save(state, checkpoint_id=str(tmp), storage_writer=_writer(tmp, step))
                crash_faults.kill_point("before_publish", step)
                self._publish(tmp, final)
        except (OSError, CheckpointException) as e:
            self._abandon(tmp, e)
            return False
        return True

    def save_weights(self, step: int, model_state: dict[str, torch.Tensor],
                     train_state: dict[str, Any], planner=None) -> Path:
        """A model-only checkpoint (`"weights_only": true` in train_state.json), the importer's
        step 0: the trainer loads its weights into any layout and starts a fresh optimizer,
        schedule and data order. `planner` may resolve each tensor lazily (the importer
        streams them); each tensor then gets a file of its own, because DCP's writer keeps
        every tensor of a file alive until that file is written. Published like any save; on
        failure its temporary directory is removed and the error raised (every rank calls)."""
        tmp, final = self.root / f".tmp-step-{step:08d}", self.root / f"step-{step:08d}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            payload = {**train_state, "step": step, "weights_only": True,
                       "world_size": dist.get_world_size()}
            (tmp / "train_state.json").write_text(json.dumps(payload))
        dist.barrier()
        try:
            writer = FileSystemWriter(str(tmp), single_file_per_rank=planner is None)
            dcp.save({"model": model_state}, checkpoint_id=str(tmp), planner=planner,
                     storage_writer=writer)
            self._publish(tmp, final)
        except BaseException:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def poll(self) -> None:
        """Publish a pending asynchronous save as soon as every rank's write is done (call
        once per step on every rank), so a crash loses at most the save still in flight."""
        if self._pending is None:
            return
        done = torch.tensor([int(self._pending[0].done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if done.item():
            self.wait()

    def wait(self) -> None:
        if self._pending is not None:
            future, tmp, final = self._pending
            self._pending = None
            try:
                future.result()
                self._publish(tmp, final)
            except (OSError, CheckpointException) as e:
                self._abandon(tmp, e)

    def _abandon(self, tmp: Path, e: BaseException) -> None:
        """A save failed on some rank (every rank gets here): drop its temporary directory."""
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            last = self.complete_steps()
            kept = f"step-{last[-1]:08d} is intact" if last else "there is none yet"
            print(f"warning: checkpoint {tmp.name.removeprefix('.tmp-')} not saved "
                  f"({_one_line(e)}); the previous checkpoint {kept}; training goes on and "
                  "the next interval tries again", flush=True)
        dist.barrier()

    def _record_checksums(self, tmp: Path) -> None:
        """checksums.json: size and SHA-256 of every file in `tmp`, hashed by all ranks."""
        world = dist.get_world_size()
        names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != CHECKSUMS)
        mine = {n: [(tmp / n).stat().st_size, _sha256(tmp / n)] for n in names[self.rank::world]}
        parts: list = [None] * world
        dist.all_gather_object(parts, mine)
        if self.rank == 0:
            record = {n: {"bytes": v[0], "sha256": v[1]}
                      for part in parts for n, v in part.items()}
            with open(tmp / CHECKSUMS, "w") as f:
                json.dump(dict(sorted(record.items())), f, indent=1)
                f.flush()
                os.fsync(f.fileno())

    def _publish(self, tmp: Path, final: Path) -> None:
        dist.barrier()  # every rank's shards are on disk
        self._record_checksums(tmp)
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
        """Load model and optimizer (resharding as needed); return the train_state dict. A
        model-only checkpoint (`weights_only`, from the importer) loads the model alone."""
        train_state = json.loads((path / "train_state.json").read_text())
        state = {"model": get_model_state_dict(model)}
        if not train_state.get("weights_only"):
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        if "optim" in state:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        rngs = train_state.pop("rng", None)
        if train_state.pop("world_size", None) == dist.get_world_size() and rngs:
            set_rng_state(rngs[self.rank])
        return train_state

"""Where a run starts and what it saves: `resume_or_init` and `save_train_state`.

The train state is {step, tokens_seen, skipped_steps} plus what lives in its checkpoint: the
model (router biases and balancing statistics included), the optimizer, the scheduler, the data
loader's position and the RNG states (`train.checkpoint.checkpointer.Checkpointer`). A run
starts from, in this order: the latest intact checkpoint of its run directory (everything
restored; a damaged one is named and skipped), imported weights there (`train.checkpoint.
import_hf`: the model only), a release named by `checkpoint.init_from` (each rank reads its own
slices), or nothing (the initialised weights).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from data.loader import BatchLoader
from model.config import ConfigError
from train.checkpoint.checkpointer import Checkpointer
from train.checkpoint.release_reader import load_release
from train.config import JobConfig
from train.distributed import DistEnv
from train.faults import crash


def fresh_state() -> dict[str, Any]:
    return {"step": 0, "tokens_seen": 0, "skipped_steps": 0}


def resume_or_init(job: JobConfig, env: DistEnv, ckpt: Checkpointer, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer, scheduler, loader: BatchLoader
                   ) -> dict[str, Any]:
    """Load what this run starts from into the model, optimizer, scheduler and loader; returns
    the train state. A data position the loader refuses (another corpus or batch layout) is a
    `ConfigError`, raised before anything is written."""
    say = (lambda m: print(m, flush=True)) if env.is_main else (lambda m: None)
    path = (ckpt.latest_intact(lambda m: print(m, flush=True))
            if job.checkpoint.enabled and job.checkpoint.resume else None)
    ckpt.clean_partial()
    if path is None:
        if job.checkpoint.init_from:
            reader = load_release(model, job.checkpoint.init_from, job.model)
            say(f"initialised from the release {job.checkpoint.init_from} (rank 0 read "
                f"{reader.bytes_read / 2**30:.2f} GiB): fresh optimizer, schedule and data order")
        return fresh_state()
    ts = ckpt.load(path, model, optimizer)
    if ts.get("weights_only"):  # imported weights (train.checkpoint.import_hf): the rest fresh
        say(f"initialised from the imported weights of {path.name} ({ts.get('source', '?')}): "
            "fresh optimizer, schedule and data order")
        return fresh_state()
    try:
        loader.load_state_dict(ts["loader"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    scheduler.load_state_dict(ts["scheduler"])
    if int(path.name.split("-")[1]) != ts["step"] or scheduler.last_epoch != ts["step"]:
        raise RuntimeError(f"checkpoint {path} is inconsistent (train_state step {ts['step']}, "
                           f"scheduler step {scheduler.last_epoch}); refusing to resume")
    restart = crash.attempt()
    say(f"resumed from {path.name}" + (f" (torchrun restart {restart})" if restart else ""))
    if loader.resume_note:
        say(loader.resume_note)
    return {"step": ts["step"], "tokens_seen": ts["tokens_seen"],
            "skipped_steps": ts.get("skipped_steps", 0)}  # 0: checkpoints from before it


def save_train_state(ckpt: Checkpointer, job: JobConfig, env: DistEnv, state: dict[str, Any],
                     model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                     loader: BatchLoader) -> None:
    """A checkpoint of everything `resume_or_init` restores (asynchronous where configured)."""
    t0 = time.perf_counter()
    saved = ckpt.save(state["step"], model, optimizer, {
        **state, "loader": loader.state_dict(), "scheduler": scheduler.state_dict(),
        "model_config": asdict(job.model), "optim_name": job.optim.name})
    if saved and env.is_main:
        print(f"checkpoint step-{state['step']:08d} "
              f"{'started' if ckpt.async_save else 'saved'} in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)

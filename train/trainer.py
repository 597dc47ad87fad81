"""The training loop: `train()` shows the whole run and `train_step` the whole step.

A run: build the layout's model, optimizer and schedule, start from what the run directory or
a release holds (`train.train_state.resume_or_init`), then per step: read the global batch's
share of this rank, forward and backward (`train_step`), and if the step is finite the updates
after the optimizer step (QK-Clip, the LR schedule, the router biases); the instruments around
it are one `StepObservers` and the test-only faults one `StepFaults`.

Loss is the token mean over the whole global batch, whatever the layout: each micro-batch
contributes sum/global_tokens (times the data-parallel size, because FSDP averages gradients
over data ranks: `ParallelModel.loss_scale`). Quantile-Balancing histograms are summed over all
ranks once per step and the router biases are updated after the optimizer step. Everything a
layout needs of the step is behind `ParallelModel` (`parallel.parallel_model`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from data.loader import local_target_tokens
from model.mtp import stack_targets
from parallel.dims import ParallelDims
from parallel.grads import clip_grad_norm
from parallel.parallel_model import ParallelModel
from parallel.parallelize import parallelize
from train.checkpoint.checkpointer import Checkpointer
from train.config import JobConfig, micro_batches, save_resolved_config
from train.distributed import DistEnv
from train.faults.nonfinite import StepFaults, poison_grad, poison_loss
from train.host_memory import keep_freed_memory
from train.observe.flops import step_flops
from train.observe.observers import StepObservers, StepUpdates, SyncCounts
from train.optim.build import build_optimizer, build_scheduler
from train.optim.qk_clip import AttnLogits
from train.preflight import build_loader, build_val_loader, check_same_model, describe_data
from train.train_state import resume_or_init, save_train_state


def train(job: JobConfig, env: DistEnv) -> dict[str, Any]:
    """Train `job` on this rank; returns the final train state."""
    if env.device.type == "cpu":
        keep_freed_memory()  # activations live in host memory: no page faults every step
    say = (lambda m: print(m, flush=True)) if env.is_main else (lambda m: None)
    dims = ParallelDims.from_config(job.parallel, env.world_size)
    meshes = dims.build_meshes(env.device.type)
    check_same_model(job)  # (the launcher's preflight ran these checks before)
    loader = build_loader(job, meshes.dp_rank, dims.dp)
    val_loader = build_val_loader(job, meshes.dp_rank, dims.dp)
    lines, warnings = describe_data(job, loader, val_loader) if env.is_main else ([], [])
    for line in lines + warnings:
        say(line)
    pm = parallelize(job, dims, meshes, env.device, micro_batches(job.data, dims.dp), log=say)
    say(pm.describe())
    model = pm.model
    logits = AttnLogits(pm, job.optim.qk_clip_tau, job.train.track_attn_logits)
    optimizer = build_optimizer(model, job.optim)
    scheduler = build_scheduler(optimizer, job.train.steps, job.optim)
    ckpt = Checkpointer(job.run_dir / "checkpoints", job.checkpoint.keep, env.rank,
                        async_save=(env.device.type == "cuda" if job.checkpoint.async_save is None
                                    else job.checkpoint.async_save))
    state = resume_or_init(job, env, ckpt, model, optimizer, scheduler, loader)
    if env.is_main:
        save_resolved_config(job, job.run_dir)
    stop = job.train.stop_at_step or job.train.steps
    faults = StepFaults(job.debug, env.rank, env.world_size)
    skipped = SkippedSteps(job.train.max_skipped_in_a_row, env.is_main)
    observers = StepObservers(job, env, pm, optimizer, scheduler, loader, val_loader,
                              state["step"], stop)
    try:
        while state["step"] < stop:
            step = state["step"] + 1
            observers.begin(step)
            logits.reset()
            batches = loader.next_step()
            flops = batch_flops(job.model, batches)  # host data: the loader's cu_seqlens
            with observers.counting(), faults.during(model, step) as where:
                result = train_step(pm, optimizer, batches, env, job.optim.grad_clip,
                                    observers.syncs, flops, where)
            updates = None
            if result.skipped:  # nothing of this step lands: no update, bias, clip or LR step
                pm.drop_routing_stats()
                skipped.record(state, step, result.nonfinite_ranks)
            else:
                skipped.in_a_row = 0
                updates = StepUpdates(logit_metrics=logits.after_step(),
                                      router_ratios=pm.balance_routers())
                scheduler.step()
            state["step"] = step
            state["tokens_seen"] += job.data.global_batch * job.data.seq_len
            observers.end(step, state, result, updates, batches)  # -> metrics, W&B, images
            ckpt.poll()  # publish the previous asynchronous save once it is written
            skipped.check(step)
            if job.checkpoint.enabled and (step % job.checkpoint.interval == 0 or step == stop):
                save_train_state(ckpt, job, env, state, model, optimizer, scheduler, loader)
        ckpt.wait()
    finally:
        observers.close()
    return state


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); one line for the user."""


class SkippedSteps:
    """Counts non-finite steps (cumulative in the train state, and in a row)."""

    def __init__(self, limit: int, is_main: bool) -> None:
        self.limit, self.is_main, self.in_a_row = limit, is_main, 0

    def record(self, state: dict, step: int, ranks: tuple[int, ...]) -> None:
        state["skipped_steps"] += 1
        self.in_a_row += 1
        if self.is_main:
            who = f"rank(s) {list(ranks)}" if ranks else "the reduced gradient norm"
            print(f"step {step}: non-finite loss or gradient on {who}: step skipped (no update, "
                  f"router statistics dropped, LR held; {state['skipped_steps']} skipped so far)",
                  flush=True)

    def check(self, step: int) -> None:
        if self.in_a_row >= self.limit:
            raise TrainingStopped(
                f"{self.in_a_row} non-finite steps in a row (train.max_skipped_in_a_row="
                f"{self.limit}) up to step {step}; no checkpoint holds an update from them: "
                "lower optim.lr or inspect the data, then resume")


class StepResult(NamedTuple):
    loss: float  # the global token-mean loss of the next-token head
    tokens: int  # global target tokens
    grad_norm: float  # before clipping
    flops: float  # model FLOPs of the global batch
    mtp_loss: float | None  # the MTP head's token-mean loss (None without MTP)
    # ranks whose loss was not finite, else those whose (reduced) gradients were not
    nonfinite_ranks: tuple[int, ...] = ()

    @property
    def skipped(self) -> bool:
        """No optimizer step was taken: a loss or the gradient norm was not finite."""
        return bool(self.nonfinite_ranks) or not (math.isfinite(self.loss)
                                                  and math.isfinite(self.grad_norm))


def train_step(pm: ParallelModel, optimizer: torch.optim.Optimizer, batches: list[dict],
               env: DistEnv, grad_clip: float, syncs: SyncCounts | None = None,
               local_flops: float = 0.0, faults: frozenset[str] = frozenset()) -> StepResult:
    """Forward/backward over this rank's micro-batches (or the pipeline schedule), clip, step.

    `local_flops` summed over the data-parallel ranks gives the global batch's model FLOPs.
    The objective is (next-token loss sum + mtp_loss_weight x MTP loss sum) / global targets.
    Host reads per step outside the model: the global token counts (with the FLOPs), the loss
    sums and the gradient norm (one each), plus the router-balancing ratios after the step.
    A non-finite loss or gradient on any rank (both are reduced over every rank, so all ranks
    agree) skips the optimizer step; the gradients are dropped. `faults`: test-only injection
    on this rank (`train.faults.nonfinite.StepFaults.during` yields it).
    """
    in_model = syncs.model if syncs else contextlib.nullcontext()
    model, cfg = pm.model, pm.model.config
    mtp = cfg.num_nextn_predict_layers > 0
    if mtp:  # (main, MTP) targets from the full host rows, before any layout splits them
        batches = [{**b, "labels": stack_targets(b["labels"])} for b in batches]
    global_tokens, global_flops, global_mtp = _global_counts(pm, batches, local_flops, mtp)
    scale = pm.loss_scale(global_tokens)
    if pm.schedule is not None:  # under PP: the loss sum only
        loss_sum = poison_loss(pm.pipeline_forward_backward(batches, scale, in_model),
                               "loss" in faults)
    else:
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        for i, mb in enumerate(batches):
            ids, packing, labels = pm.prepare(mb, first=i == 0, last=i == len(batches) - 1)
            with in_model:
                s, _ = model(ids, packing, labels=labels)
                s = poison_loss(s, "loss" in faults and i == 0)
                (s * scale).backward()
            loss_sum += s.detach().double()
    if "grad" in faults:
        poison_grad(model)
    sums = torch.stack([loss_sum, _pop_mtp_sums(model, env.device)])
    # [loss, gradients] x ranks, all-reduced with the gradient norm: the loss flags name the
    # rank a NaN came from (gradients are non-finite on every rank after a reduce-scatter)
    flags = torch.zeros(2, env.world_size, dtype=torch.float64, device=env.device)
    flags[0, env.rank] = (~torch.isfinite(sums).all()).double()
    sums = pm.finish_grads(sums)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = clip_grad_norm(model.parameters(), max_norm, pm.dims.pp, optimizer, flags)
    total, mtp_sum, *flat = torch.cat([sums, flags.flatten()]).tolist()  # one read
    loss_bad, grad_bad = ([r for r in range(env.world_size) if flat[i * env.world_size + r] > 0]
                          for i in (0, 1))
    result = StepResult((total - cfg.mtp_loss_weight * mtp_sum if mtp else total)
                        / max(global_tokens, 1), global_tokens, norm, global_flops,
                        mtp_sum / max(global_mtp, 1) if mtp else None,
                        tuple(loss_bad or grad_bad))
    if not result.skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result


def _global_counts(pm: ParallelModel, batches: list[dict], local_flops: float, mtp: bool
                   ) -> tuple[int, float, float]:
    """(target tokens, model FLOPs, MTP targets) of the global batch: one all-reduce over the
    data ranks and one host read."""
    mtp_targets = sum(int((b["labels"][..., 1] != -100).sum()) for b in batches) if mtp else 0
    counts = torch.tensor([local_target_tokens(batches), local_flops, mtp_targets],
                          dtype=torch.float64, device=pm.device)
    dist.all_reduce(counts, group=pm.meshes.dp_group)
    tokens, flops, mtp_tokens = counts.tolist()
    return int(tokens), flops, mtp_tokens


def _pop_mtp_sums(model, device: torch.device) -> torch.Tensor:
    """This step's MTP loss sum on this rank (float64; 0 without MTP or off the last stage)."""
    sums = model.mtp_loss_sums
    total = (torch.stack(sums).double().sum() if sums
             else torch.zeros((), dtype=torch.float64, device=device))
    sums.clear()
    return total


def batch_flops(cfg, batches: list[dict]) -> float:
    """Model FLOPs of this rank's micro-batches from their document lengths (host cu_seqlens):
    `train.observe.flops.step_flops`, so packed short documents are not credited with long
    attention."""
    lengths: list[int] = []
    for b in batches:
        lengths += b["cu_seqlens"].diff().tolist()
    return step_flops(cfg, lengths)

"""`StepObservers`: everything the training loop measures around a step, behind begin / end.

`begin(step)` starts the step's clocks (wall, per-rank compute, profiler) and counters; `end(...)`
turns the step into its scalars and writes them (metrics.jsonl, console, W&B through
`MetricsLogger`), with what is due at that step: validation loss, diagnostic images, sample ids.
The pieces: `StepProfiler` (`train.profile_steps`), `ComputeClock` + `StragglerDetector`,
`SyncCounts` (`train.count_host_syncs`), `SpikeLog`, the per-layer router / EP load statistics,
`Validator` (`eval.*`), memory. Collectives here run on every rank in the same order.

Deliberately not here: anything that changes the weights, the router biases or the schedule
(the trainer does those; `end` only reads what they returned).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from data.loader import BatchLoader
from model.decoder import K3Model
from parallel.expert_parallel import ep_load_metrics
from parallel.fsdp import DTYPES
from parallel.parallel_model import ParallelModel
from train.config import JobConfig, plain_config
from train.distributed import DistEnv
from train.evaluate import Validator
from train.observe.flops import peak_flops
from train.observe.host_syncs import HostSyncCounter
from train.observe.layout_images import attnres_weights, router_matrices
from train.observe.metrics import MetricsLogger, memory_stats
from train.observe.model_stats import moe_layer_indices
from train.observe.profiling import StepProfiler, format_summary
from train.observe.stragglers import ComputeClock, StragglerDetector, gather_seconds


class StepUpdates(NamedTuple):
    """What the updates after an optimizer step returned, for the observers to report."""

    router_ratios: list[float]  # max/mean expert load of each of this rank's MoE layers
    logit_metrics: dict  # `AttnLogits.after_step`: attn_logit_max, qk_clipped_heads, ...


class SyncCounts:
    """Host-sync counters of one step: `step` (all of it) and `model` (inside the model's
    forward and backward: entered around each micro-batch, or around the pipeline schedule)."""

    def __init__(self) -> None:
        self.step, self.model = HostSyncCounter(), HostSyncCounter()

    def metrics(self) -> dict:
        return {"host_syncs_model": self.model.total, "host_syncs_step": self.step.total,
                "host_syncs_by_op": [f"{k}={v}" for k, v in sorted(self.step.counts.items())],
                "host_syncs_model_by_op": [f"{k}={v}"
                                           for k, v in sorted(self.model.counts.items())]}


class SpikeLog:
    """Logs a loss above `factor` x the running median of the last 100 finite losses."""

    def __init__(self, factor: float, is_main: bool) -> None:
        self.factor, self.is_main = factor, is_main
        self.recent: list[float] = []
        self.last: int | None = None  # the step of the latest spike

    def check(self, step: int, loss: float) -> None:
        if self.factor and len(self.recent) >= 10:
            median = sorted(self.recent)[len(self.recent) // 2]
            if loss > self.factor * median:
                self.last = step
                if self.is_main:
                    print(f"step {step}: loss spike {loss:.4f} > {self.factor:g} x running "
                          f"median {median:.4f}", flush=True)
        self.recent = (self.recent + [loss])[-100:]


class StepObservers:
    """The loop's instruments; every rank builds one (only rank 0 writes)."""

    def __init__(self, job: JobConfig, env: DistEnv, pm: ParallelModel,
                 optimizer: torch.optim.Optimizer, scheduler, loader: BatchLoader,
                 val_loader: BatchLoader | None, start_step: int, stop_step: int) -> None:
        self.job, self.env, self.pm, self.scheduler, self.loader = job, env, pm, scheduler, loader
        self.stop_step = stop_step
        model, debug, t = pm.model, job.debug, job.train
        self.validator = Validator(val_loader, job.eval.batches) if val_loader else None
        self.clock = ComputeClock(model, env.device,
                                  debug.slow_rank_s if debug.slow_rank == env.rank else 0.0)
        self.stragglers = StragglerDetector(t.straggler_factor, t.straggler_steps, env.is_main)
        self.spikes = SpikeLog(t.spike_factor, env.is_main)
        self.peak = (job.cluster.peak_tflops * 1e12 if job.cluster.peak_tflops
                     else peak_flops(env.device))
        self.act_dtype = DTYPES[job.cluster.param_dtype]
        self.metrics = MetricsLogger(job.run_dir, env.rank, t.steps, plain_config(job),
                                     wandb_mode=job.metrics.wandb_mode,
                                     wandb_project=job.metrics.wandb_project,
                                     run_name=job.run.name, console=job.metrics.console)
        self.metrics.start(start_step)
        self.profiler = StepProfiler(t.profile_steps, model, optimizer, job.run_dir, env.rank,
                                     env.device)
        self.syncs: SyncCounts | None = None
        self.t0, self.lr = 0.0, 0.0

    def begin(self, step: int) -> None:
        """Before the step's batches are read."""
        self.profiler.before_step(step)
        self.clock.reset()
        self.t0 = time.perf_counter()
        ep_load_metrics(self.pm.model)  # drop dispatches outside training steps (images)
        self.syncs = SyncCounts() if self.job.train.count_host_syncs else None
        self.lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses

    def counting(self) -> contextlib.AbstractContextManager:
        """Around the whole step: the host-sync counter's `step` count (when on)."""
        return self.syncs.step if self.syncs else contextlib.nullcontext()

    def end(self, step: int, state: dict, result, updates: StepUpdates | None,
            batches: list[dict]) -> dict[str, Any]:
        """The step's scalars, written (rank 0) with what is due at `step`; `updates` is None
        for a skipped step."""
        env, job, model = self.env, self.job, self.pm.model
        stage = self.pm.meshes.pp_rank if self.pm.meshes.pp is not None else 0
        compute = self.stragglers.update(step, *gather_seconds(
            self.clock.step_seconds(), stage, env.rank, env.world_size, env.device))
        loads: dict = {}
        if updates is not None:
            loads = _layer_stats(model, updates.router_ratios, ep_load_metrics(model),
                                 self.pm.meshes.pp.get_group() if self.pm.meshes.pp else None)
            self.spikes.check(step, result.loss)
        dt = time.perf_counter() - self.t0
        summary = self.profiler.after_step(step)
        if summary is not None and env.is_main:
            print(format_summary(summary), flush=True)
            print(f"profile trace: {job.run_dir / 'profile'}/trace-rank<r>.json (Perfetto)",
                  flush=True)
        evaluated = (self.validator.losses(self.pm, env, self.act_dtype)
                     if self.validator is not None and (step % job.eval.every == 0
                                                        or step == self.stop_step) else {})
        scalars = {
            "loss": result.loss, "lr": self.lr, "grad_norm": result.grad_norm,
            "tokens_per_sec": job.data.global_batch * job.data.seq_len / dt,
            **({} if result.mtp_loss is None else {"mtp_loss": result.mtp_loss}),
            "mfu": (result.flops / dt / (env.world_size * self.peak)) if self.peak else None,
            "model_flops": result.flops, "step_time_s": dt, "tokens_seen": state["tokens_seen"],
            "epoch": self.loader.position / self.loader.num_samples, **compute, **evaluated,
            **loads, **(updates.logit_metrics if updates else {}), **memory_stats(env.device),
            **(self.syncs.metrics() if self.syncs else {}),
            "skipped_steps": state["skipped_steps"],
            **({"skipped_ranks": list(result.nonfinite_ranks)} if result.skipped else {}),
            **({"loss_spike": 1} if self.spikes.last == step else {})}
        if job.train.log_sample_ids:
            scalars["sample_ids"] = _global_sample_ids(batches, env, self.pm.meshes.dp_group)
        self.metrics.log_step(step, scalars)
        if job.train.log_images_every and step % job.train.log_images_every == 0:
            self._log_images(step, batches[0])
        for m in model.moe_layers():
            m.gate.expert_load.zero_()
        return scalars

    def close(self) -> None:
        self.clock.close()
        self.metrics.close()

    def _log_images(self, step: int, batch: dict) -> None:
        """The three diagnostic images of the whole model, in any layout (every rank calls)."""
        ids = batch["input_ids"][:1].to(self.env.device)
        cu = batch["cu_seqlens"]
        cu = cu[cu <= ids.shape[1]]  # the first row's documents only (host boundaries)
        weights, labels = attnres_weights(self.pm, ids, cu, self.act_dtype)
        load, bias, layer_ids = router_matrices(self.pm)
        if self.env.is_main:
            self.metrics.log_images(step, load, weights, labels, bias, moe_layer_ids=layer_ids)


def _layer_stats(model: K3Model, ratios: list[float], ep: dict, pp_group) -> dict:
    """Per-MoE-layer load statistics of the whole model (gathered over pipeline stages), with
    their means over layers."""
    rows = list(zip(moe_layer_indices(model), ratios, ep.get("ep_rank_load_static", []) or
                    [None] * len(ratios), ep.get("ep_rank_load_replicated", []) or
                    [None] * len(ratios)))
    if pp_group is not None:
        parts: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, rows, group=pp_group)
        rows = sorted(r for part in parts for r in part)
    out: dict = {"expert_load_max_over_mean":
                 sum(r[1] for r in rows) / len(rows) if rows else None,
                 "expert_load_per_layer": [r[1] for r in rows],
                 "moe_layer_ids": [r[0] for r in rows]}
    if rows and rows[0][2] is not None:
        static, replicated = [r[2] for r in rows], [r[3] for r in rows]
        out.update(ep_rank_load_static=static, ep_rank_load_replicated=replicated,
                   ep_rank_load_static_mean=sum(static) / len(static),
                   ep_rank_load_replicated_mean=sum(replicated) / len(replicated))
    return out


def _global_sample_ids(batches: list[dict], env: DistEnv, group) -> list[int]:
    """This step's sample ids over all data ranks, in global-batch order (for resume checks)."""
    local = torch.cat([b["sample_ids"] for b in batches]).to(env.device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).tolist()

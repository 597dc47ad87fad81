"""The training loop: one screen that shows the whole step; the details live in helpers.

Loss is the token mean over the whole global batch, whatever the layout: each micro-batch
contributes sum/global_tokens (times the data-parallel size, because FSDP averages gradients
over data ranks). Quantile-Balancing histograms are summed over all ranks once per step and the
router biases are updated after the optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from data.loader import BatchLoader, local_target_tokens
from model.config import ConfigError
from model.decoder import K3Model
from model.moe import apply_quantile_balancing
from model.mtp import stack_targets
from model.packing import (
    Packing,
    check_cu_seqlens,
    max_seqlen_bucket,
    pad_cu_seqlens,
    shard_window,
    to_device,
)
from parallel.dims import ParallelDims
from parallel.expert_parallel import ep_load_metrics, finalize_expert_grads
from parallel.fsdp import DTYPES, set_gradient_sync
from parallel.grads import clip_grad_norm
from parallel.parallelize import ParallelModel, parallelize
from parallel.tensor_parallel import allreduce_replicated_grads
from train.checkpoint.checkpointer import Checkpointer
from train.checkpoint.release_reader import load_release
from train.config import JobConfig, micro_batches
from train.distributed import DistEnv
from train.evaluate import Validator
from train.faults import crash as crash_faults
from train.faults.nonfinite import Injections, poison_grad, poison_loss, poisoned_activation
from train.host_memory import keep_freed_memory
from train.observe.flops import peak_flops, step_flops
from train.observe.host_syncs import HostSyncCounter
from train.observe.layout_images import attnres_weights, router_matrices
from train.observe.metrics import MetricsLogger, memory_stats
from train.observe.model_stats import moe_layer_indices
from train.observe.profiling import StepProfiler, format_summary
from train.observe.stragglers import ComputeClock, StragglerDetector, gather_seconds
from train.optim.build import build_optimizer, build_scheduler
from train.optim.qk_clip import qk_clip, qk_clip_metrics, reset_logits, track_logits
from train.preflight import build_loader, build_val_loader, check_same_model, describe_data


def train(job: JobConfig, env: DistEnv) -> dict[str, Any]:
    """Train `job` on this rank; returns the final train state."""
    if env.device.type == "cpu":
        keep_freed_memory()  # activations live in host memory: no page faults every step
    dims = ParallelDims.from_config(job.parallel, env.world_size)
    meshes = dims.build_meshes(env.device.type)
    dp_rank = meshes.dp_rank
    run_dir = job.run_dir
    async_save = job.checkpoint.async_save
    ckpt = Checkpointer(run_dir / "checkpoints", job.checkpoint.keep, env.rank,
                        async_save=env.device.type == "cuda" if async_save is None else async_save)
    resume_from = (ckpt.latest_intact(lambda m: print(m, flush=True))
                   if job.checkpoint.enabled and job.checkpoint.resume else None)
    check_same_model(job)  # (the launcher's preflight ran these checks before)
    loader = build_loader(job, dp_rank, dims.dp)
    val_loader = build_val_loader(job, dp_rank, dims.dp)
    if env.is_main:
        lines, warnings = describe_data(job, loader, val_loader)
        for line in lines + warnings:
            print(line, flush=True)
    resumed_state = (json.loads((resume_from / "train_state.json").read_text())
                     if resume_from is not None else {})
    if resumed_state and not resumed_state.get("weights_only"):
        _load_loader_state(loader, resumed_state)  # a refused data state writes nothing
    if env.is_main:
        _save_resolved_config(job, run_dir)
    n_micro = micro_batches(job.data, dims.dp)
    pm = parallelize(job, dims, meshes, env.device, n_micro,
                     log=lambda m: print(m, flush=True) if env.is_main else None)
    if env.is_main:
        _describe_layout(pm, env)
    model = pm.model
    tau = job.optim.qk_clip_tau
    if tau is not None:
        track_logits(model, env.device)
    optimizer = build_optimizer(model, job.optim)
    scheduler = build_scheduler(optimizer, job.train.steps, job.optim)
    state: dict[str, Any] = {"step": 0, "tokens_seen": 0, "skipped_steps": 0}
    ckpt.clean_partial()
    if resume_from is not None:
        state = _resume(ckpt, resume_from, model, optimizer, scheduler, loader)
        if env.is_main and resumed_state.get("weights_only"):
            print(f"initialised from the imported weights of {resume_from.name} ("
                  f"{resumed_state.get('source', '?')}): fresh optimizer, schedule and data "
                  "order", flush=True)
        elif env.is_main:
            restart = crash_faults.attempt()
            print(f"resumed from {resume_from.name}"
                  + (f" (torchrun restart {restart})" if restart else ""), flush=True)
            if loader.resume_note:
                print(loader.resume_note, flush=True)
    elif job.checkpoint.init_from:  # a new run from a release: this rank reads its own slices
        reader = load_release(model, job.checkpoint.init_from, job.model)
        if env.is_main:
            print(f"initialised from the release {job.checkpoint.init_from} (rank 0 read "
                  f"{reader.bytes_read / 2**30:.2f} GiB): fresh optimizer, schedule and data "
                  "order", flush=True)

    injections = Injections(job.debug, env.rank, env.world_size)
    validator = Validator(val_loader, job.eval.batches) if val_loader is not None else None
    clock = ComputeClock(model, env.device,
                         job.debug.slow_rank_s if job.debug.slow_rank == env.rank else 0.0)
    stragglers = StragglerDetector(job.train.straggler_factor, job.train.straggler_steps,
                                   env.is_main)
    stage = meshes.pp_rank if meshes.pp is not None else 0
    skipped = SkippedSteps(job.train.max_skipped_in_a_row, env.is_main)
    spikes = SpikeLog(job.train.spike_factor, env.is_main)
    stop = job.train.stop_at_step or job.train.steps
    peak = job.cluster.peak_tflops * 1e12 if job.cluster.peak_tflops else peak_flops(env.device)
    metrics = MetricsLogger(run_dir, env.rank, job.train.steps, _plain(job),
                            wandb_mode=job.metrics.wandb_mode,
                            wandb_project=job.metrics.wandb_project, run_name=job.run.name,
                            console=job.metrics.console)
    metrics.start(state["step"])
    profiler = StepProfiler(job.train.profile_steps, model, optimizer, run_dir, env.rank,
                            env.device)
    crash_faults.start_random_kill()
    try:
        while state["step"] < stop:
            profiler.before_step(state["step"] + 1)
            clock.reset()
            t0 = time.perf_counter()
            ep_load_metrics(model)  # drop dispatches outside training steps (image forwards)
            batches = loader.next_step()
            flops = batch_flops(job.model, batches)  # host data: the loader's cu_seqlens
            syncs = SyncCounts() if job.train.count_host_syncs else None
            if tau is not None:
                reset_logits(model)
            with (syncs.step if syncs else contextlib.nullcontext(),
                  crash_faults.step_kill_hooks(model, state["step"] + 1)):
                result = train_step(pm, optimizer, batches, env, job.optim.grad_clip, syncs,
                                    flops, frozenset(injections.at(state["step"] + 1)))
            compute = stragglers.update(state["step"] + 1, *gather_seconds(
                clock.step_seconds(), stage, env.rank, env.world_size, env.device))
            loss, _, grad_norm, step_model_flops, mtp_loss, bad_ranks = result
            lr = scheduler.get_last_lr()[0]
            if result.skipped:  # nothing of this step lands: no update, bias, clip or LR step
                qk, loads = {}, {}
                _drop_routing_stats(model)
                skipped.record(state, state["step"] + 1, bad_ranks)
            else:
                skipped.in_a_row = 0
                qk = {} if tau is None else _qk_clip(pm, job.model, tau, env.device)
                scheduler.step()
                loads = _layer_stats(model, balance_routers(model, meshes.batch_group),
                                     ep_load_metrics(model),
                                     meshes.pp.get_group() if meshes.pp is not None else None)
                spikes.check(state["step"] + 1, loss)
            state["step"] += 1
            state["tokens_seen"] += job.data.global_batch * job.data.seq_len
            dt = time.perf_counter() - t0
            summary = profiler.after_step(state["step"])
            if summary is not None and env.is_main:
                print(format_summary(summary), flush=True)
                print(f"profile trace: {run_dir / 'profile'}/trace-rank<r>.json (Perfetto)",
                      flush=True)
            tps = job.data.global_batch * job.data.seq_len / dt
            evaluated = (validator.losses(pm, env, DTYPES[job.cluster.param_dtype])
                         if validator is not None and (state["step"] % job.eval.every == 0
                                                       or state["step"] == stop) else {})
            scalars = {
                "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
                **({} if mtp_loss is None else {"mtp_loss": mtp_loss}),
                "mfu": (step_model_flops / dt / (env.world_size * peak)) if peak else None,
                "model_flops": step_model_flops,
                "step_time_s": dt, "tokens_seen": state["tokens_seen"],
                "epoch": loader.position / loader.num_samples, **compute, **evaluated,
                **loads, **qk,
                **memory_stats(env.device),
                **(syncs.metrics() if syncs else {}),
                "skipped_steps": state["skipped_steps"],
                **({"skipped_ranks": list(bad_ranks)} if result.skipped else {}),
                **({"loss_spike": 1} if spikes.last == state["step"] else {})}
            if job.train.log_sample_ids:
                scalars["sample_ids"] = _global_sample_ids(batches, env, meshes.dp_group)
            metrics.log_step(state["step"], scalars)
            if job.train.log_images_every and state["step"] % job.train.log_images_every == 0:
                _log_images(pm, metrics, state["step"], batches[0], env,
                            DTYPES[job.cluster.param_dtype])
            _reset_expert_loads(model)
            ckpt.poll()  # publish the previous asynchronous save once it is written
            skipped.check(state["step"])
            done = state["step"] == stop
            if job.checkpoint.enabled and (state["step"] % job.checkpoint.interval == 0 or done):
                t_save = time.perf_counter()
                saved = ckpt.save(state["step"], model, optimizer, {
                    **state, "loader": loader.state_dict(), "scheduler": scheduler.state_dict(),
                    "model_config": asdict(job.model), "optim_name": job.optim.name})
                if saved and env.is_main:
                    print(f"checkpoint step-{state['step']:08d} "
                          f"{'started' if ckpt.async_save else 'saved'} in "
                          f"{time.perf_counter() - t_save:.2f} s", flush=True)
        ckpt.wait()
    finally:
        clock.close()
        metrics.close()
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


def _drop_routing_stats(model: K3Model) -> None:
    """A skipped step's Quantile-Balancing histograms and expert loads (and EP's) are void."""
    for moe in model.moe_layers():
        moe.gate.qb_counts.zero_()
    _reset_expert_loads(model)
    ep_load_metrics(model)


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
    on this rank (`train.faults.nonfinite`).
    """
    in_model = syncs.model if syncs else contextlib.nullcontext()
    model, dims = pm.model, pm.dims
    cfg = model.config
    mtp = cfg.num_nextn_predict_layers > 0
    if mtp:  # (main, MTP) targets from the full host rows, before any layout splits them
        batches = [{**b, "labels": stack_targets(b["labels"])} for b in batches]
    mtp_targets = sum(int((b["labels"][..., 1] != -100).sum()) for b in batches) if mtp else 0
    counts = torch.tensor([local_target_tokens(batches), local_flops, mtp_targets],
                          dtype=torch.float64, device=env.device)
    dist.all_reduce(counts, group=pm.meshes.dp_group)
    global_tokens, global_flops, global_mtp = counts.tolist()
    global_tokens = int(global_tokens)
    # FSDP averages over dp x cp ranks: undo, then / tokens
    scale = dims.loss_scale_ranks / max(global_tokens, 1)
    with poisoned_activation(model, "activation" in faults):
        if pm.schedule is not None:
            loss_sum = poison_loss(_pipeline_forward_backward(pm, batches, env, scale, in_model),
                                   "loss" in faults)  # under PP: the loss sum only
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
            if pm.main_grads is not None:  # fused accumulation: zero, hand to FSDP2
                pm.main_grads.begin_step()
            for i, mb in enumerate(batches):
                set_gradient_sync(model, i == len(batches) - 1,
                                  keep_gathered=pm.keep_gathered)
                ids = to_device(mb["input_ids"], env.device)  # pinned, non-blocking on CUDA
                packing = Packing.from_host(mb["cu_seqlens"], *ids.shape, env.device,
                                            bucket=pm.compiled)
                labels = cp_window(to_device(mb["labels"], env.device), pm.model)
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
    dist.all_reduce(sums)  # data ranks; 0 on non-last pp stages
    sums /= dims.tp  # the vocabulary-parallel loss: every tp rank holds the full sum
    if pm.tp_params:
        allreduce_replicated_grads(pm.tp_params, pm.meshes.tp.get_group())
    finalize_expert_grads(pm.expert_params, dims.expert_grad_divisor)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = clip_grad_norm(model.parameters(), max_norm, dims.pp, optimizer, flags)
    total, mtp_sum, *flat = torch.cat([sums, flags.flatten()]).tolist()  # one read
    main = total - cfg.mtp_loss_weight * mtp_sum if mtp else total
    loss_bad, grad_bad = ([r for r in range(env.world_size) if flat[i * env.world_size + r] > 0]
                          for i in (0, 1))
    result = StepResult(main / max(global_tokens, 1), global_tokens, norm, global_flops,
                        mtp_sum / max(global_mtp, 1) if mtp else None,
                        tuple(loss_bad or grad_bad))
    if not result.skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result


def cp_window(labels: torch.Tensor, model: K3Model) -> torch.Tensor:
    """Whole rows of labels -> this rank's context-parallel slice (the model takes whole rows
    of token ids and windows them itself)."""
    return labels if model.context_shard is None else shard_window(labels, *model.context_shard)


def _pop_mtp_sums(model: K3Model, device: torch.device) -> torch.Tensor:
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


def _pipeline_forward_backward(pm: ParallelModel, batches: list[dict], env: DistEnv,
                               scale: float, in_model=None) -> torch.Tensor:
    """Run the schedule over this rank's micro-batches; returns the local loss sum (float64)."""
    dev = env.device
    ids = to_device(torch.cat([b["input_ids"] for b in batches]), dev)
    labels = cp_window(to_device(torch.cat([b["labels"] for b in batches]), dev), pm.model)
    B, T = batches[0]["input_ids"].shape
    # validated on the host; one row per micro-batch, padded with empty documents to one width
    longest = max(check_cu_seqlens(b["cu_seqlens"], B, T) for b in batches)
    if pm.compiled:  # one host int baked into compiled graphs: a few values, not one per step
        longest = max_seqlen_bucket(longest, T)
    cu = to_device(pad_cu_seqlens([b["cu_seqlens"] for b in batches], B * T), dev)
    pm.loss_scale.value = scale
    losses: list[torch.Tensor] = []
    args = (ids,) if pm.has_first_stage else ()
    with in_model or contextlib.nullcontext():
        pm.schedule.step(*args, target=labels, losses=losses, return_outputs=False,
                         cu_seqlens=cu, seq_len=T, max_seqlen=longest, labels=labels)
    total = torch.zeros((), dtype=torch.float64, device=dev)
    if pm.has_last_stage:
        total += torch.stack([x.detach() for x in losses]).double().sum() / scale
    return total


@torch.no_grad()
def balance_routers(model: K3Model, group=None) -> float | None:
    """Sum QB histograms and expert loads over the ranks that route other tokens through the
    same layers (`group`: dp x tp; default all), in one all-reduce; update router biases.

    Returns max/mean expert load this step of each of this rank's MoE layers.
    """
    routers = [m.gate for m in model.moe_layers()]
    if not routers:
        return []
    flat = torch.cat([torch.cat([r.qb_counts.flatten(), r.expert_load]) for r in routers])
    dist.all_reduce(flat, group=group)
    dst, src, offset = [], [], 0
    for r in routers:  # the reduced sums back into the buffers: one foreach copy
        for buf in (r.qb_counts, r.expert_load):
            dst.append(buf)
            src.append(flat[offset:offset + buf.numel()].view_as(buf))
            offset += buf.numel()
    torch._foreach_copy_(dst, src)
    apply_quantile_balancing(routers)
    loads = torch.stack([r.expert_load.double() for r in routers])  # [layers, E]
    return (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).tolist()  # one host read


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


def _qk_clip(pm: ParallelModel, cfg, tau: float, device: torch.device) -> dict:
    """QK-Clip after the optimizer step (`train.optim.qk_clip`) and its metrics."""
    tp = pm.dims.tp
    offset = 0 if tp == 1 else pm.meshes.tp.get_local_rank() * (cfg.num_attention_heads // tp)
    S = qk_clip(pm.model, tau, cfg.num_layers_with_mtp, cfg.num_attention_heads, device, offset)
    mla = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
    if cfg.num_nextn_predict_layers and cfg.mtp_layer_type == "mla":
        mla.append(cfg.num_hidden_layers)  # the MTP layer
    return qk_clip_metrics(S, tau, mla)


def _global_sample_ids(batches: list[dict], env: DistEnv, group) -> list[int]:
    """This step's sample ids over all data ranks, in global-batch order (for resume checks)."""
    local = torch.cat([b["sample_ids"] for b in batches]).to(env.device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).tolist()


def _reset_expert_loads(model: K3Model) -> None:
    for m in model.moe_layers():
        m.gate.expert_load.zero_()


def _log_images(pm: ParallelModel, metrics: MetricsLogger, step: int, batch: dict,
                env: DistEnv, act_dtype: torch.dtype) -> None:
    """The three diagnostic images of the whole model, in any layout (every rank calls)."""
    ids = batch["input_ids"][:1].to(env.device)
    cu = batch["cu_seqlens"]
    cu = cu[cu <= ids.shape[1]]  # the first row's documents only (host boundaries)
    weights, labels = attnres_weights(pm, ids, cu, act_dtype)
    load, bias, layer_ids = router_matrices(pm)
    if env.is_main:
        metrics.log_images(step, load, weights, labels, bias, moe_layer_ids=layer_ids)


def _describe_layout(pm: ParallelModel, env: DistEnv) -> None:
    d = pm.dims
    msg = (f"layout: world {d.world_size} = pp {d.pp} x dp_replicate {d.dp_replicate} x "
           f"dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}; ep {d.ep}")
    if pm.splits:
        msg += (f"; {d.pp_schedule}, {d.num_stages} stages (layers "
                f"{[f'{s[0]}-{s[-1]}' for s in pm.splits]})")
    print(msg, flush=True)


def _resume(ckpt: Checkpointer, path: Path, model, optimizer, scheduler, loader
            ) -> dict[str, Any]:
    ts = ckpt.load(path, model, optimizer)
    if ts.get("weights_only"):  # imported weights (train.checkpoint.import_hf): everything else is fresh
        return {"step": 0, "tokens_seen": 0, "skipped_steps": 0}
    scheduler.load_state_dict(ts["scheduler"])
    _load_loader_state(loader, ts)
    if int(path.name.split("-")[1]) != ts["step"] or scheduler.last_epoch != ts["step"]:
        raise RuntimeError(f"checkpoint {path} is inconsistent (train_state step {ts['step']}, "
                           f"scheduler step {scheduler.last_epoch}); refusing to resume")
    return {"step": ts["step"], "tokens_seen": ts["tokens_seen"],
            "skipped_steps": ts.get("skipped_steps", 0)}  # 0: checkpoints from before it


def _load_loader_state(loader: BatchLoader, train_state: dict) -> None:
    try:
        loader.load_state_dict(train_state["loader"])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _plain(job: JobConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(job), resolve=True)  # type: ignore


def _save_resolved_config(job: JobConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    os.replace(tmp, run_dir / "config.yaml")

"""The training loop: one screen that shows the whole step; the details live in helpers.

Loss is the token mean over the whole global batch, whatever the layout: each micro-batch
contributes sum/global_tokens (times the data-parallel size, because FSDP averages gradients
over data ranks). Quantile-Balancing histograms are summed over all ranks once per step and the
router biases are updated after the optimizer step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from data.corpus import default_corpus_dir
from data.dataset import PackedTokenDataset
from data.loader import BatchLoader, local_target_tokens
from data.tokenizer import load_tokenizer
from model.build import build_model
from model.config import ConfigError
from model.decoder import K3Model
from model.init import init_weights
from model.ops.mx_linear import mx_backend
from model.precision import apply_mxfp8
from parallel.dims import ParallelDims
from parallel.expert_parallel import (
    apply_expert_parallel,
    ep_load_metrics,
    expert_parameters,
    finalize_expert_grads,
)
from parallel.fsdp import apply_fsdp, dtensor_writer, set_gradient_sync, unsharded_root
from train.checkpoint import Checkpointer
from train.config import JobConfig
from train.distributed import DistEnv
from train.flops import flops_per_token, mfu, peak_flops
from train.metrics import MetricsLogger, memory_stats
from train.model_stats import (
    attnres_depth_weights,
    expert_load_matrix,
    moe_layer_indices,
    router_bias_matrix,
)
from train.optim import build_optimizer, build_scheduler


def train(job: JobConfig, env: DistEnv) -> dict[str, Any]:
    """Train `job` on this rank; returns the final train state."""
    dims = ParallelDims.from_config(job.parallel, env.world_size)
    mesh = dims.build_mesh(env.device.type)
    dp_rank = mesh.get_local_rank("dp_shard") + (
        mesh.get_local_rank("dp_replicate") * dims.dp_shard if dims.dp_replicate > 1 else 0)
    run_dir = job.run_dir
    ckpt = Checkpointer(run_dir / "checkpoints", job.checkpoint.keep, env.rank,
                        async_save=job.checkpoint.async_save and env.device.type == "cuda")
    _check_same_model(job, ckpt, run_dir)
    loader = _build_loader(job, env, dp_rank, dims.dp)  # may still reject the config
    if env.is_main:
        _save_resolved_config(job, run_dir)
    model = _build_sharded_model(job, env, mesh, dims)
    optimizer = build_optimizer(model, job.optim)
    scheduler = build_scheduler(optimizer, job.train.steps, job.optim)
    state: dict[str, Any] = {"step": 0, "tokens_seen": 0}
    ckpt.clean_partial()
    latest = ckpt.latest() if job.checkpoint.enabled and job.checkpoint.resume else None
    if latest is not None:
        state = _resume(ckpt, latest, model, optimizer, scheduler, loader)

    stop = job.train.stop_at_step or job.train.steps
    fpt = flops_per_token(job.model, job.data.seq_len)
    peak = job.cluster.peak_tflops * 1e12 if job.cluster.peak_tflops else peak_flops(env.device)
    metrics = MetricsLogger(run_dir, env.rank, job.train.steps, _plain(job),
                            wandb_mode=job.metrics.wandb_mode,
                            wandb_project=job.metrics.wandb_project, run_name=job.run.name,
                            console=job.metrics.console)
    metrics.start(state["step"])
    try:
        while state["step"] < stop:
            t0 = time.perf_counter()
            ep_load_metrics(model)  # drop dispatches outside training steps (image forwards)
            batches = loader.next_step()
            loss, _, grad_norm = train_step(model, optimizer, batches, env, dims,
                                            job.optim.grad_clip)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            loads = balance_routers(model)
            state["step"] += 1
            state["tokens_seen"] += job.data.global_batch * job.data.seq_len
            dt = time.perf_counter() - t0
            tps = job.data.global_batch * job.data.seq_len / dt
            scalars = {
                "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
                "mfu": mfu(tps / env.world_size, fpt, peak) if peak else None,
                "step_time_s": dt, "tokens_seen": state["tokens_seen"],
                "expert_load_max_over_mean": loads, **ep_load_metrics(model),
                **memory_stats(env.device)}
            if job.train.log_sample_ids:
                scalars["sample_ids"] = _global_sample_ids(batches, env)
            metrics.log_step(state["step"], scalars)
            if job.train.log_images_every and state["step"] % job.train.log_images_every == 0:
                _log_images(model, metrics, state["step"], batches[0], env)
            _reset_expert_loads(model)
            done = state["step"] == stop
            if job.checkpoint.enabled and (state["step"] % job.checkpoint.interval == 0 or done):
                t_save = time.perf_counter()
                ckpt.save(state["step"], model, optimizer, {
                    **state, "loader": loader.state_dict(), "scheduler": scheduler.state_dict(),
                    "model_config": asdict(job.model)})
                if env.is_main:
                    print(f"checkpoint step-{state['step']:08d} "
                          f"{'started' if ckpt.async_save else 'saved'} in "
                          f"{time.perf_counter() - t_save:.2f} s", flush=True)
        ckpt.wait()
    finally:
        metrics.close()
    return state


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict],
               env: DistEnv, dims: ParallelDims, grad_clip: float) -> tuple[float, int, float]:
    """Forward/backward over this rank's micro-batches, clip, optimizer step.

    Returns (global token-mean loss, global target tokens, gradient norm before clipping).
    """
    counts = torch.tensor([local_target_tokens(batches)], dtype=torch.float64, device=env.device)
    dist.all_reduce(counts)
    global_tokens = int(counts.item())
    scale = dims.dp / max(global_tokens, 1)  # FSDP averages over dp ranks: undo, then / tokens
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    for i, mb in enumerate(batches):
        set_gradient_sync(model, i == len(batches) - 1)
        s, _ = model(mb["input_ids"].to(env.device), mb["cu_seqlens"].to(env.device),
                     labels=mb["labels"].to(env.device))
        (s * scale).backward()
        loss_sum += s.detach().double()
    dist.all_reduce(loss_sum)
    finalize_expert_grads(getattr(model, "expert_params", set()), dims.dp)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / max(global_tokens, 1), global_tokens, float(norm)


@torch.no_grad()
def balance_routers(model: K3Model) -> float | None:
    """Sum QB histograms and expert loads over all ranks (one all-reduce), update router biases.

    Returns the mean over MoE layers of max/mean expert load this step (None without MoE).
    """
    routers = [m.gate for m in model.moe_layers()]
    if not routers:
        return None
    flat = torch.cat([torch.cat([r.qb_counts.flatten(), r.expert_load]) for r in routers])
    dist.all_reduce(flat)
    offset = 0
    for r in routers:
        n, E = r.qb_counts.numel(), r.expert_load.numel()
        r.qb_counts.copy_(flat[offset:offset + n].view_as(r.qb_counts))
        r.expert_load.copy_(flat[offset + n:offset + n + E])
        offset += n + E
        r.apply_quantile_balancing()
    ratios = [float(r.expert_load.max()) / max(float(r.expert_load.float().mean()), 1e-9)
              for r in routers]
    return sum(ratios) / len(ratios)


def _global_sample_ids(batches: list[dict], env: DistEnv) -> list[int]:
    """This step's sample ids over all data ranks, in global-batch order (for resume checks)."""
    local = torch.cat([b["sample_ids"] for b in batches]).to(env.device)
    parts = [torch.empty_like(local) for _ in range(env.world_size)]  # world == dp (FSDP only)
    dist.all_gather(parts, local)
    return torch.cat(parts).tolist()


def _reset_expert_loads(model: K3Model) -> None:
    for m in model.moe_layers():
        m.gate.expert_load.zero_()


def _log_images(model: K3Model, metrics: MetricsLogger, step: int, batch: dict,
                env: DistEnv) -> None:
    ids = batch["input_ids"][:1].to(env.device)
    cu = batch["cu_seqlens"]
    cu = cu[cu <= ids.shape[1]].to(env.device)  # the first row's documents only
    with unsharded_root(model):
        weights, labels = attnres_depth_weights(model, ids, cu)
    if env.is_main:
        metrics.log_images(step, expert_load_matrix(model), weights, labels,
                           router_bias_matrix(model), moe_layer_ids=moe_layer_indices(model))


def _build_loader(job: JobConfig, env: DistEnv, dp_rank: int, dp: int) -> BatchLoader:
    d = job.data
    if d.dataset == "stdlib":
        folder = default_corpus_dir(d.tokenizer, max_bytes=d.stdlib_max_bytes)
    else:
        folder = Path(d.dataset)
    dataset = PackedTokenDataset(folder, d.seq_len)
    vocab = load_tokenizer(d.tokenizer).vocab_size
    if vocab > job.model.vocab_size:
        raise ConfigError(f"data.tokenizer has {vocab} tokens but model.vocab_size="
                          f"{job.model.vocab_size}; raise model.vocab_size to >= {vocab}")
    return BatchLoader(dataset, d.global_batch, d.micro_batch, dp_rank, dp, d.seed)


def _build_sharded_model(job: JobConfig, env: DistEnv, mesh, dims: ParallelDims) -> K3Model:
    """Build on meta, shard (experts by EP, the rest by FSDP2), then allocate and initialise
    only the local shards. The expert parameters are kept in `model.expert_params`."""
    model = build_model(job.model, device="meta")
    expert_params: set = set()
    if dims.expert_parallel:
        expert_params = apply_expert_parallel(model, mesh, job.parallel.ep_replicas)
    p = job.precision
    if p.gemm == "mxfp8":
        converted = apply_mxfp8(model, p.targets, p.mx_mode, p.wgrad_hp)
        if env.is_main:
            print(f"precision: MXFP8 ({mx_backend(env.device)} backend, {p.mx_mode}) on "
                  f"{len(converted)} GEMM modules: {', '.join(p.targets)}", flush=True)
    apply_fsdp(model, mesh, job.cluster.param_dtype, job.cluster.reduce_dtype,
               job.parallel.reshard_after_forward, ignored_params=expert_params)
    model.to_empty(device=env.device)
    init_weights(model, job.train.seed, write=dtensor_writer)
    model.expert_params = expert_parameters(model) if expert_params else set()
    return model


def _resume(ckpt: Checkpointer, path: Path, model, optimizer, scheduler, loader
            ) -> dict[str, Any]:
    ts = ckpt.load(path, model, optimizer)
    scheduler.load_state_dict(ts["scheduler"])
    loader.load_state_dict(ts["loader"])
    if int(path.name.split("-")[1]) != ts["step"] or scheduler.last_epoch != ts["step"]:
        raise RuntimeError(f"checkpoint {path} is inconsistent (train_state step {ts['step']}, "
                           f"scheduler step {scheduler.last_epoch}); refusing to resume")
    return {"step": ts["step"], "tokens_seen": ts["tokens_seen"]}


def _check_same_model(job: JobConfig, ckpt: Checkpointer, run_dir: Path) -> None:
    latest = ckpt.latest()
    if latest is None or not job.checkpoint.resume:
        return
    saved = json.loads((latest / "train_state.json").read_text()).get("model_config", {})
    diff = sorted(k for k, v in asdict(job.model).items() if saved.get(k) != v)
    if diff:
        raise ConfigError(f"run.dir={str(run_dir)!r} holds checkpoints of a different model "
                          f"(model.{diff[0]} differs); use another run.dir or the same model")


def _plain(job: JobConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(job), resolve=True)  # type: ignore


def _save_resolved_config(job: JobConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    os.replace(tmp, run_dir / "config.yaml")

"""The optimizers (AdamW with K3's weight-decay exclusions; Per-Head Muon + AdamW,
`train.optim.muon`) and the learning-rate schedules (cosine, WSD)."""

from __future__ import annotations

import math

import torch
from torch import nn

from model.ops.backends import cuda_backends_forced
from train.config import OptimConfig


def no_weight_decay(name: str, p: torch.Tensor) -> bool:
    """Norm weights, gates' biases (dt_bias, A_log), AttnRes pseudo-queries: all vectors."""
    return p.ndim < 2 or name.endswith("_res_proj.weight")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """`optim=adamw`: AdamW over two groups (decay / no decay). On CUDA and CPU torch's fused
    AdamW (one multi-tensor kernel per step for the whole update, as torchtitan defaults to; on a
    CPU 2.7x fewer CPU seconds than the per-parameter loop for the `cpu_bench` model,
    `python benchmarks/optimizer_step_cpu.py --threads 2`: 0.047 vs 0.125 s, the same fp32 and
    fp64 values); elsewhere torch's default implementation. Fake-tensor traces with CUDA
    backends forced (the roofline) take the CUDA choice. `optim=muon`: `train.optim.muon.MuonAdamW`
    (Per-Head Muon on the decoder's matrices, the same AdamW on the rest)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and (cuda_backends_forced()
                              or all(p.device.type in ("cuda", "cpu") for p in params))
    if cfg.name == "muon":
        from train.optim.muon import MuonAdamW

        return MuonAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                         momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                         betas=tuple(cfg.betas), eps=cfg.eps, fused_adamw=True if fused else None)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=True if fused else None)


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of optim.lr for the update at 0-based `step` of `total`."""
    warmup = max(1, math.ceil(cfg.warmup_frac * total)) if cfg.warmup_frac > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_start = total - max(1, round(cfg.decay_frac * total))  # wsd: warmup, stable, decay
    if step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / max(1, total - decay_start)
    return 1.0 - (1.0 - lo) * min(1.0, progress)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, cfg))

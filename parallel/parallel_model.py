"""`ParallelModel`: this rank's share of the model and what its layout asks of a training step.

The trainer's step is layout-free apart from one `if` (a pipeline schedule or a loop over
micro-batches). Everything else a layout needs goes through here:
- `prepare(micro_batch, first, last)`: one micro-batch on the device in this layout's form
  (gradient sync on the last only, fused accumulation started on the first, the labels windowed
  to this rank's context-parallel slice, the packing bucketed for compiled layers);
- `pipeline_forward_backward(batches, scale)`: the schedule over this rank's micro-batches;
- `loss_scale(global_tokens)`: the factor on each micro-batch's loss sum (FSDP averages the
  gradients over dp x cp ranks, so it is undone here, then / tokens);
- `finish_grads(loss_sums)`: after the last backward, the loss sums reduced over the ranks and
  the gradient fix-ups (tensor-parallel replicated gradients summed over tp, expert gradients'
  leftover data-parallel factor);
- `balance_routers()`: Quantile-Balancing histograms and expert loads summed over the ranks
  that route other tokens through the same layers, then the router-bias update (or
  `drop_routing_stats()` after a skipped step).

Deliberately not here: the optimizer, clipping and anything the loop observes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model.decoder import K3Model
from model.moe import apply_quantile_balancing
from model.packing import (
    Packing,
    check_cu_seqlens,
    max_seqlen_bucket,
    pad_cu_seqlens,
    shard_window,
    to_device,
)
from parallel.dims import Meshes, ParallelDims
from parallel.expert_parallel import ep_load_metrics, finalize_expert_grads
from parallel.fsdp import set_gradient_sync
from parallel.grad_accumulation import MainGrads
from parallel.pipeline import LossScale
from parallel.tensor_parallel import allreduce_replicated_grads


@dataclass
class ParallelModel:
    """`model`: this rank's (pruned, sharded) model: optimizer and checkpoints use it."""

    model: K3Model
    dims: ParallelDims
    meshes: Meshes
    expert_params: set = field(default_factory=set)
    tp_params: list = field(default_factory=list)  # tp-replicated: gradients summed over tp
    schedule: object | None = None
    pipeline_loss_scale: LossScale | None = None  # the schedule's loss reads it
    stages: list[int] = field(default_factory=list)
    splits: list[list[int]] = field(default_factory=list)
    stage_modules: list = field(default_factory=list)  # PipelineStageModule per local stage
    compiled: bool = False  # decoder layers wrapped in torch.compile (parallel.compile)
    keep_gathered: bool = False  # FSDP units stay gathered over a step's micro-batches
    main_grads: MainGrads | None = None  # fused gradient accumulation (parallel.grad_accumulation)
    device: torch.device = field(default_factory=lambda: torch.device("meta"))  # materialised on

    @property
    def has_first_stage(self) -> bool:
        return not self.splits or 0 in self.stages

    @property
    def has_last_stage(self) -> bool:
        return not self.splits or len(self.splits) - 1 in self.stages

    def describe(self) -> str:
        """One line: the layout (and the pipeline stages' layers)."""
        d = self.dims
        msg = (f"layout: world {d.world_size} = pp {d.pp} x dp_replicate {d.dp_replicate} x "
               f"dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}; ep {d.ep}")
        if self.splits:
            msg += (f"; {d.pp_schedule}, {d.num_stages} stages (layers "
                    f"{[f'{s[0]}-{s[-1]}' for s in self.splits]})")
        return msg

    # ------------------------------------------------------------------ one training step
    def loss_scale(self, global_tokens: int) -> float:
        """The factor on each loss sum before backward: the global token mean, times the ranks
        FSDP averages the gradients over (dp x cp)."""
        return self.dims.loss_scale_ranks / max(global_tokens, 1)

    def prepare(self, micro_batch: dict, first: bool, last: bool
                ) -> tuple[torch.Tensor, Packing, torch.Tensor]:
        """(input ids, packing, labels) of one micro-batch of a step without pipeline
        parallelism, on the device; gradients reduce on the `last` micro-batch only."""
        device = self.device
        if first and self.main_grads is not None:  # fused accumulation: zero, hand to FSDP2
            self.main_grads.begin_step()
        set_gradient_sync(self.model, last, keep_gathered=self.keep_gathered)
        ids = to_device(micro_batch["input_ids"], device)  # pinned, non-blocking on CUDA
        packing = Packing.from_host(micro_batch["cu_seqlens"], *ids.shape, device,
                                    bucket=self.compiled)
        return ids, packing, self.window(to_device(micro_batch["labels"], device))

    def window(self, labels: torch.Tensor) -> torch.Tensor:
        """Whole rows of labels -> this rank's context-parallel slice (the model takes whole
        rows of token ids and windows them itself)."""
        shard = self.model.context_shard
        return labels if shard is None else shard_window(labels, *shard)

    def pipeline_forward_backward(self, batches: list[dict], scale: float, in_model=None
                                  ) -> torch.Tensor:
        """Run the schedule over this rank's micro-batches (`in_model`: a context around it);
        returns the local loss sum (float64; 0 off the last stage)."""
        device = self.device
        ids = to_device(torch.cat([b["input_ids"] for b in batches]), device)
        labels = self.window(to_device(torch.cat([b["labels"] for b in batches]), device))
        B, T = batches[0]["input_ids"].shape
        # validated on the host; one row per micro-batch, padded with empty documents
        longest = max(check_cu_seqlens(b["cu_seqlens"], B, T) for b in batches)
        if self.compiled:  # one host int baked into compiled graphs: a few values, not one a step
            longest = max_seqlen_bucket(longest, T)
        cu = to_device(pad_cu_seqlens([b["cu_seqlens"] for b in batches], B * T), device)
        self.pipeline_loss_scale.value = scale
        losses: list[torch.Tensor] = []
        args = (ids,) if self.has_first_stage else ()
        with in_model or contextlib.nullcontext():
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False,
                               cu_seqlens=cu, seq_len=T, max_seqlen=longest, labels=labels)
        total = torch.zeros((), dtype=torch.float64, device=device)
        if self.has_last_stage:
            total += torch.stack([x.detach() for x in losses]).double().sum() / scale
        return total

    def finish_grads(self, loss_sums: torch.Tensor) -> torch.Tensor:
        """After the last backward: `loss_sums` (this rank's, float64) summed over the ranks,
        and the gradients completed for this layout; returns the global sums."""
        dist.all_reduce(loss_sums)  # data ranks; 0 on non-last pp stages
        loss_sums /= self.dims.tp  # the vocabulary-parallel loss: every tp rank holds the sum
        if self.tp_params:
            allreduce_replicated_grads(self.tp_params, self.meshes.tp.get_group())
        finalize_expert_grads(self.expert_params, self.dims.expert_grad_divisor)
        return loss_sums

    @torch.no_grad()
    def balance_routers(self) -> list[float]:
        """Sum QB histograms and expert loads over the ranks that route other tokens through
        the same layers (dp x tp: `meshes.batch_group`), in one all-reduce; update the router
        biases. Returns max/mean expert load this step of each of this rank's MoE layers."""
        return balance_routers(self.model, self.meshes.batch_group)

    def drop_routing_stats(self) -> None:
        """A skipped step's Quantile-Balancing histograms and expert loads (EP's too) are void."""
        for moe in self.model.moe_layers():
            moe.gate.qb_counts.zero_()
            moe.gate.expert_load.zero_()
        ep_load_metrics(self.model)

    def tp_head_offset(self, num_heads: int) -> int:
        """The global index of this rank's first attention head (tensor parallelism)."""
        tp = self.dims.tp
        return 0 if tp == 1 else self.meshes.tp.get_local_rank() * (num_heads // tp)


@torch.no_grad()
def balance_routers(model: K3Model, group=None) -> list[float]:
    """`ParallelModel.balance_routers` for a bare model (`group`: default all ranks)."""
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

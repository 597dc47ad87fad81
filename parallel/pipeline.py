"""Pipeline parallelism with `torch.distributed.pipelining` for the K3 model.

Stages are contiguous runs of decoder layers, split by cost (each layer's active parameters;
the LM head's cost counts on the last stage), embedding on the first stage and the output mix,
norm and head on the last. A rank keeps one pruned `K3Model` holding the layers of all its
stages, under their global names, so checkpoints move between layouts. The AttnRes state
crosses stage boundaries as two ordinary activations, `prefix [B, T, d]` and `blocks
[n, B, T, d]`; document boundaries travel as `cu_seqlens [n_micro, W]`, a keyword input every
stage gets a row of (each micro-batch's boundaries padded with empty documents to one width,
so it splits along dim 0 like the tokens; host ints `seq_len` and `max_seqlen` ride along
unsplit): no stage derives boundaries with a host sync. The last stage returns the
micro-batch's loss sum, and the schedule's loss function scales it by data-parallel size over
global tokens (`scale_grads=False`: the schedule must not average over micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.config import ModelConfig
from model.decoder import K3Model


def layer_costs(cfg: ModelConfig) -> list[float]:
    """Per-layer cost: active parameters (FLOPs per token are ~6x that) of each decoder layer;
    the MTP module (on the last stage) is added to the last layer's."""
    model = K3Model(cfg, device="meta")
    costs = [_active(layer, cfg) for layer in model.layers.values()]
    if model.mtp is not None:  # its own tensors, and the second pass through the LM head
        costs[-1] += _active(model.mtp, cfg) + float(cfg.vocab_size * cfg.hidden_size)
    return costs


def _active(module: nn.Module, cfg: ModelConfig) -> float:
    n = 0
    for name, p in module.named_parameters():
        if ".experts." in name:  # routed experts: only top-k of E are active
            n += p.numel() * cfg.num_experts_per_token // cfg.num_experts
        else:
            n += p.numel()
    return float(n)


def split_stages(cfg: ModelConfig, num_stages: int) -> list[list[int]]:
    """Contiguous layer ranges, one per stage, minimising the most expensive stage (exact DP)."""
    costs = layer_costs(cfg)
    costs[-1] += float(cfg.vocab_size * cfg.hidden_size)  # the LM head rides on the last stage
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages > {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-stage cost of the first i layers in s stages; cut[s][i]: last start
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [list(range(a, b)) for a, b in reversed(bounds)]


def stage_indices(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """The stages this pp rank runs: round-robin (loop), or the V shape for ZBVZeroBubble."""
    if schedule == "ZBVZeroBubble":
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def prune_to_stages(model: K3Model, splits: list[list[int]], stages: list[int]) -> None:
    """Drop every layer (and the embedding / output parts) this rank's stages do not run."""
    keep = {str(i) for s in stages for i in splits[s]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if 0 not in stages:
        model.embed_tokens = None
    if len(splits) - 1 not in stages:
        model.output_attn_res_norm = model.output_attn_res_proj = None
        model.norm = model.lm_head = model.mtp = None


class PipelineStageModule(nn.Module):
    """One stage: a view onto the rank's pruned model, for `PipelineStage` and FSDP.

    Its children are the stage's own layers (and embedding or output parts), so `parameters()`
    is exactly the stage's; the model itself is held outside the module tree so parameter
    names stay the model's."""

    def __init__(self, model: K3Model, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)
        self.layer_ids = [str(i) for i in layer_ids]
        self.first, self.last = first, last
        self.layers = nn.ModuleList(model.layers[k] for k in self.layer_ids)
        if first:
            self.embed_tokens = model.embed_tokens
        if last:
            self.output = nn.ModuleList([model.output_attn_res_norm, model.output_attn_res_proj,
                                         model.norm, model.lm_head])
            if model.mtp is not None:
                self.mtp = model.mtp

    def forward(self, *inputs: torch.Tensor, cu_seqlens: torch.Tensor, seq_len: int,
                max_seqlen: int | None = None, labels: torch.Tensor | None = None):
        out = self.model.forward_stage(*inputs, cu_seqlens=cu_seqlens, seq_len=seq_len,
                                       max_seqlen=max_seqlen, labels=labels,
                                       layer_ids=self.layer_ids, first=self.first,
                                       last=self.last)
        if self.last:
            return out
        # a layer passes `blocks` through unchanged (and every stage the MTP's next-token
        # embeddings), and FSDP turns layer inputs into views; the zero-bubble schedules detach
        # stage outputs in place, which views (and inputs) do not allow
        return tuple(t.clone() if t._is_view() or any(t is i for i in inputs) else t
                     for t in out)


@dataclass
class LossScale:
    """Set before each step: micro-batch loss sums are multiplied by `value` for backward."""

    value: float = 1.0


def stage_io_meta(cfg: ModelConfig, splits: list[list[int]], stage: int, micro_batch: int,
                  seq_len: int, tp: int, dtype: torch.dtype, cp: int = 1
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Meta tensors of a stage's inputs and outputs, given to `PipelineStage` so that it does
    not infer them by running the model (the router and MoE dispatch are data-dependent).
    A stage that starts at layer L receives ceil(L / block_size) AttnRes snapshots, and with
    MTP the next tokens' embeddings [B, T/(cp tp), d] (`K3Model.forward_stage`); the first
    stage takes whole rows of token ids."""
    local_t = seq_len // (cp * tp)  # context and sequence parallelism: a slice of every row
    d, bs = cfg.hidden_size, cfg.attn_res_block_size

    def act(*lead: int) -> torch.Tensor:
        return torch.empty(*lead, micro_batch, local_t, d, dtype=dtype, device="meta",
                           requires_grad=True)

    def state(layer: int) -> tuple[torch.Tensor, ...]:
        prefix_blocks = (act(), act(-(-layer // bs)))
        return prefix_blocks + (act(),) * cfg.num_nextn_predict_layers  # + e_next with MTP

    first, last = splits[stage][0], splits[stage][-1] + 1
    inputs = ((torch.empty(micro_batch, seq_len, dtype=torch.long, device="meta"),)
              if stage == 0 else state(first))
    loss_dtype = torch.promote_types(dtype, torch.float32)  # `model.loss`: fp32 or wider sums
    outputs = ((torch.empty((), dtype=loss_dtype, device="meta", requires_grad=True),)
               if stage == len(splits) - 1 else state(last))
    return inputs, outputs


def build_schedule(stage_modules: list[PipelineStageModule], stages: list[int],
                   num_stages: int, schedule: str, pp_group, device: torch.device,
                   n_microbatches: int, scale: LossScale,
                   io_meta: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]):
    """The `torch.distributed.pipelining` schedule over this rank's stages."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        get_schedule_class,
    )

    pipe_stages = [PipelineStage(m, s, num_stages, device, input_args=io[0], output_args=io[1],
                                 group=pp_group)
                   for m, s, io in zip(stage_modules, stages, io_meta, strict=True)]
    cls = get_schedule_class(schedule)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out * scale.value

    if issubclass(cls, PipelineScheduleSingle):
        return cls(pipe_stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                   scale_grads=False)
    return cls(pipe_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)

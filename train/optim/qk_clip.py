"""QK-Clip (Kimi K2's MuonClip, kept in K3) for the Gated MLA heads, in any layout.

After each optimizer step every MLA head h whose step logit bound S_h exceeds tau
(`optim.qk_clip_tau`) is rescaled so that its logits shrink by f = tau / S_h: the head's q_C and
k_C rows by sqrt(f), its q_R rows (which meet the 64-dim k_R shared by all heads) by f, the
shared k_R and the v rows untouched (`GatedMLA.qk_clip_rows`). Heads at or under tau are
multiplied by exactly 1, so their weights stay bit-identical. The bounds are tracked with or
without clipping (`train.track_attn_logits`: `attn_logit_max` shows how close the heads get to a
tau before one is chosen): `logit_bounds` reads them, `clip_heads` acts on them.

S_h is the largest log-sum-exp of any query's scaled logits over the step's micro-batches
(`packed_causal_attention(logit_bound=True)`: free from FlashAttention's output on CUDA, a
second blockwise Q K^T without gradient on the reference paths), an upper bound within
log(document length) of the true largest logit, so after a clip the head's true largest logit
is at most tau. KDA layers need no clip: their q and k are L2-normalised, |q.k| <= 1.

Layouts: every rank writes its own (layer, head) entries of one [layers, heads] tensor, -inf
elsewhere, and one all-reduce(MAX) over the world gives every rank the global S of every head
(data and context ranks agree, tensor-parallel ranks contribute their heads, pipeline stages
their layers). Each rank then scales its parameters' rows; a DTensor parameter (FSDP, TP) is
multiplied by a replicated row vector, which each sharding slices locally.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from model.mla import GatedMLA


def mla_modules(model: nn.Module) -> list[tuple[int, GatedMLA]]:
    """(decoder layer index, module) of every Gated MLA in `model` (a pipeline stage holds some;
    the MTP layer's index is num_hidden_layers)."""
    return [(layer.layer_idx, layer.self_attn) for layer in model.decoder_layers()
            if isinstance(layer.self_attn, GatedMLA)]


def track_logits(model: nn.Module, device: torch.device) -> None:
    """Allocate every MLA layer's bound buffer (training forwards then record into it)."""
    for _, module in mla_modules(model):
        module.track_logits(device)


def reset_logits(model: nn.Module) -> None:
    """Start a step: forget bounds recorded by earlier forwards (diagnostic ones included)."""
    for _, module in mla_modules(model):
        module.logit_max.fill_(float("-inf"))


@torch.no_grad()
def logit_bounds(model: nn.Module, num_layers: int, num_heads: int, device: torch.device,
                 head_offset: int = 0) -> torch.Tensor:
    """The step's S [num_layers, num_heads] (fp32, -inf for layers without MLA), the same on
    every rank (one all-reduce MAX). `head_offset`: the global index of this rank's first head
    (tensor parallelism)."""
    S = torch.full((num_layers, num_heads), float("-inf"), device=device)
    for layer, module in mla_modules(model):
        S[layer, head_offset:head_offset + module.num_heads] = module.logit_max
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(S, op=dist.ReduceOp.MAX)
    return S


@torch.no_grad()
def clip_heads(model: nn.Module, S: torch.Tensor, tau: float) -> None:
    """Rescale every head of `model` whose bound in S (`logit_bounds`) exceeds tau."""
    for layer, module in mla_modules(model):
        factor = torch.where(S[layer] > tau, tau / S[layer], 1.0)  # [all heads]
        for pname, rows in module.qk_clip_rows(factor).items():
            _scale_rows(module.get_parameter(pname), rows)


def qk_clip(model: nn.Module, tau: float, num_layers: int, num_heads: int,
            device: torch.device, head_offset: int = 0) -> torch.Tensor:
    """Clip every head above tau; returns the step's S (`logit_bounds`)."""
    S = logit_bounds(model, num_layers, num_heads, device, head_offset)
    clip_heads(model, S, tau)
    return S


def _scale_rows(p: torch.Tensor, rows: torch.Tensor) -> None:
    r = rows.to(p.dtype).unsqueeze(1)  # [global rows, 1]
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        r = DTensor.from_local(r.to(p.to_local().device), mesh, [Replicate()] * mesh.ndim,
                               run_check=False)
    p.mul_(r)


def qk_clip_metrics(S: torch.Tensor, tau: float | None, layer_ids: list[int]) -> dict:
    """attn_logit_max (max over MLA layers and heads), per MLA layer attn_logit_max_per_layer
    (with mla_layer_ids) and, with a tau, qk_clipped_heads: one host read."""
    rows = S[layer_ids] if layer_ids else S[:0]
    per_layer = rows.amax(dim=1) if layer_ids else rows.new_zeros(0)
    clipped = (rows > (math.inf if tau is None else tau)).sum().reshape(1).to(rows.dtype)
    packed = torch.cat([per_layer, clipped]).tolist()
    per = packed[:-1]
    out = {"attn_logit_max": max(per) if per else None, "attn_logit_max_per_layer": per,
           "mla_layer_ids": list(layer_ids)}
    return out if tau is None else {**out, "qk_clipped_heads": int(packed[-1])}


class AttnLogits:
    """The MLA heads' logit bounds over each step: tracked (`train.track_attn_logits`, on by
    default where the model has MLA layers), and clipped after the update when `tau` is set."""

    def __init__(self, pm, tau: float | None, track: bool | None) -> None:
        cfg = pm.model.config
        self.mla = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
        if cfg.num_nextn_predict_layers and cfg.mtp_layer_type == "mla":
            self.mla.append(cfg.num_hidden_layers)  # the MTP layer
        self.pm, self.tau = pm, tau
        self.on = tau is not None or (bool(self.mla) if track is None else track)
        if self.on:
            track_logits(pm.model, pm.device)

    def reset(self) -> None:
        """Before a step's forwards."""
        if self.on:
            reset_logits(self.pm.model)

    def after_step(self) -> dict:
        """After the optimizer step (every rank): QK-Clip where tau is set; the metrics."""
        if not self.on:
            return {}
        cfg = self.pm.model.config
        S = logit_bounds(self.pm.model, cfg.num_layers_with_mtp, cfg.num_attention_heads,
                         self.pm.device, self.pm.tp_head_offset(cfg.num_attention_heads))
        if self.tau is not None:
            clip_heads(self.pm.model, S, self.tau)
        return qk_clip_metrics(S, self.tau, self.mla)

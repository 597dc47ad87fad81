"""Gated Multi-head Latent Attention, NoPE (k3-architecture.md §2.1).

q-LoRA (RMSNorm eps 1e-6) -> q [H, 128+64]; kv-LoRA (RMSNorm eps 1e-6) -> k_C, v per head plus one
64-dim k_R shared by all heads; no rotary embedding (position comes from KDA); softmax scale
192^-1/2; full-rank sigmoid output gate per channel; output projection. Attention is
`model.ops.attention.packed_causal_attention`: SDPA `is_causal` for unpacked rows; for packed
documents varlen FlashAttention on CUDA or a blockwise masked SDPA elsewhere, neither of which
builds a [T, T] mask or reads tensor data on the host.

QK-Clip support (`train.optim.qk_clip`): after `track_logits()`, training forwards keep in the
buffer `logit_max` [local heads] the running maximum of each head's log-sum-exp bound on its
pre-softmax logits (`packed_causal_attention(logit_bound=True)`), and `qk_clip_rows` gives the
per-row factors that rescale a head's q_C / k_C by sqrt(tau/S) and its q_R by tau/S.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.linear import Linear
from model.norms import RMSNorm
from model.ops.attention import packed_causal_attention
from model.packing import Packing


class GatedMLA(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        d, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = H
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        qk = cfg.qk_head_dim

        def lin(i: int, o: int) -> Linear:
            return Linear(i, o, bias=False, device=device)

        if cfg.q_lora_rank is None:
            self.q_proj = lin(d, H * qk)
        else:
            self.q_a_proj = lin(d, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_lora_norm_eps, device)
            self.q_b_proj = lin(cfg.q_lora_rank, H * qk)
        self.kv_a_proj_with_mqa = lin(d, cfg.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_lora_norm_eps, device)
        self.kv_b_proj = lin(cfg.kv_lora_rank, H * (self.nope + self.v_dim))
        self.g_proj = lin(d, H * self.v_dim) if cfg.mla_use_output_gate else None
        self.o_proj = lin(H * self.v_dim, d)
        self.register_buffer("logit_max", None, persistent=False)  # `track_logits` sets it
        # context parallelism swaps in its all-to-all version (`parallel.context_parallel`)
        self.attention = packed_causal_attention

    def track_logits(self, device: torch.device | str) -> None:
        """Record each head's logit bound in training forwards (after any head sharding: the
        buffer has this module's `num_heads`), starting from -inf."""
        self.register_buffer("logit_max", torch.full((self.num_heads,), float("-inf"),
                                                     device=device), persistent=False)

    def qk_clip_rows(self, factor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row multipliers of the q and kv_b projections for per-head factors tau / S
        (<= 1; [all heads]): a head's q_C and k_C rows sqrt(f), its q_R rows f (they meet the
        shared k_R, untouched), its v rows 1. Keys: parameter names inside this module."""
        root = factor.sqrt()
        ones = torch.ones_like(factor)
        q_rows = torch.cat([root[:, None].expand(-1, self.nope),
                            factor[:, None].expand(-1, self.rope)], dim=1).reshape(-1)
        kv_rows = torch.cat([root[:, None].expand(-1, self.nope),
                             ones[:, None].expand(-1, self.v_dim)], dim=1).reshape(-1)
        q_name = "q_proj.weight" if hasattr(self, "q_proj") else "q_b_proj.weight"
        return {q_name: q_rows, "kv_b_proj.weight": kv_rows}

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.nope + self.rope)
        c_kv, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, self.nope + self.v_dim)
        k_c, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, T, H, 128], [B, T, H, 128]
        k = torch.cat([k_c, k_r.unsqueeze(2).expand(B, T, H, self.rope)], dim=-1)  # [B,T,H,192]
        if self.logit_max is not None and self.training:
            o, bound = self.attention(q, k, v, packing, self.scale, logit_bound=True)
            torch.maximum(self.logit_max, bound, out=self.logit_max)  # a recompute: idempotent
        else:
            o = self.attention(q, k, v, packing, self.scale)  # [B, T, H, v]
        o = o.reshape(B, T, H * self.v_dim)
        if self.g_proj is not None:
            compute = torch.promote_types(o.dtype, torch.float32)
            o = (o.to(compute) * torch.sigmoid(self.g_proj(x).to(compute))).to(x.dtype)
        return self.o_proj(o)

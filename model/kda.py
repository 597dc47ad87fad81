"""Kimi Delta Attention layer (k3-architecture.md §1.2-1.3): parameters and glue around the op.

Projections -> short convs (SiLU) -> `chunk_kda(gate=)` (per-head L2 norm of q/k, gate and beta
activation, the recurrence: inside fla's kernels on CUDA) -> gated RMSNorm with the full-rank
output gate -> output projection. The op lives in `model.ops.kda`; `kda_op` is the
recurrence over a `Packing` (`local_kda`; context parallelism installs its state-passing
version, `parallel.context_parallel`). Gate
(`model.ops.kda.kda_gate`): K3's lower-bounded `g_min * sigmoid(exp(A_log) * (f + dt_bias))`,
or Kimi Linear's `-exp(A_log) * softplus(f + dt_bias)` when `gate_lower_bound` is None.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.linear import Linear
from model.norms import GatedRMSNorm
from model.ops.kda import KDAGate, chunk_kda
from model.packing import Packing
from model.short_conv import ShortConv


def local_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
              b: torch.Tensor, packing: Packing, gate: KDAGate, chunk_size: int) -> torch.Tensor:
    """The KDA recurrence of [B, T, H, D] raw projections over `packing`'s documents (states
    reset at document starts) -> o [B, T, H, D]."""
    B, T, H, D = q.shape
    if not packing.packed:
        return chunk_kda(q, k, v, f, b, chunk_size=chunk_size, gate=gate)[0]
    # varlen: one row of B*T tokens with per-document state resets
    o, _ = chunk_kda(*(t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, f, b)),
                     cu_seqlens=packing.cu_seqlens, chunk_size=chunk_size,
                     cu_seqlens_cpu=packing.cu_seqlens_cpu, gate=gate)
    return o.view(B, T, H, -1)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        d, H, D = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        self.num_heads, self.head_dim = H, D
        self.lower_bound = cfg.gate_lower_bound
        self.chunk_size = cfg.kda_chunk_size

        def lin(i: int, o: int) -> Linear:
            return Linear(i, o, bias=False, device=device)

        self.q_proj, self.k_proj, self.v_proj = lin(d, H * D), lin(d, H * D), lin(d, H * D)
        self.q_conv1d = ShortConv(H * D, cfg.short_conv_kernel_size, device)
        self.k_conv1d = ShortConv(H * D, cfg.short_conv_kernel_size, device)
        self.v_conv1d = ShortConv(H * D, cfg.short_conv_kernel_size, device)
        self.f_a_proj, self.f_b_proj = lin(d, D), lin(D, H * D)
        self.A_log = nn.Parameter(torch.empty(H, device=device))
        self.dt_bias = nn.Parameter(torch.empty(H * D, device=device))
        self.b_proj = lin(d, H)
        self.g_proj = lin(d, H * D)
        self.o_norm = GatedRMSNorm(D, cfg.rms_norm_eps, device)
        self.o_proj = lin(H * D, d)
        self.kda_op = local_kda

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        pos = packing.pos_in_doc
        q = self.q_conv1d(self.q_proj(x), pos).view(B, T, H, D)
        k = self.k_conv1d(self.k_proj(x), pos).view(B, T, H, D)
        v = self.v_conv1d(self.v_proj(x), pos).view(B, T, H, D)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, D)  # gate pre-activation
        b = self.b_proj(x)  # [B, T, H] beta logits
        gate = KDAGate(self.A_log, self.dt_bias, self.lower_bound)
        o = self.kda_op(q, k, v, f, b, packing, gate, self.chunk_size)
        o = self.o_norm(o.to(x.dtype), self.g_proj(x).view(B, T, H, D))  # [B, T, H, D]
        return self.o_proj(o.reshape(B, T, H * D))

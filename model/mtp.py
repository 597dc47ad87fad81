"""Multi-token prediction (DeepSeek-V3's MTP, adapted to K3): one module predicting token t+2.

At position t, with h_t the main model's final state (the output AttnRes mix, before the
final norm) and e_{t+1} the embedding of token t+1 (the shared `embed_tokens`):

    x_t = eh_proj([enorm(e_{t+1}); hnorm(h_t)])        eh_proj: [d, 2d], no bias
    y   = layer(x)                                      one K3 decoder layer, MLA + LatentMoE
    logits_t = lm_head(shared_head.norm(y_t))           the shared LM head -> token t+2

Our choices (the report does not say): the layer has no AttnRes state of its own (prefix = x,
no snapshots, so each mix returns its prefix: a plain pre-norm residual layer), its index is
`num_hidden_layers` (Quantile Balancing, QK-Clip, export), and it sees the same documents as
the main model. With `mtp_attn_res_blocks` (K3's variant, e.g. [1, 4]) h_t is replaced by
`h_proj([b_1; b_4; h_t])` over those AttnRes block snapshots, `h_proj` initialised to
[0 0 I] so that at step 0 it passes the final state only.

Targets (`mtp_targets`): token t+2 where t, t+1 and t+2 lie in one document of the row, -100
otherwise; from the main labels alone (label t = token t+1, -100 where it opens a new
document), so the last two tokens of every document have none. The MTP loss sum is normalised
by the main loss's target count (the trainer's one division): objective = (main sum +
mtp_loss_weight x MTP sum) / main targets.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.linear import Linear
from model.loss import IGNORE_INDEX
from model.norms import RMSNorm
from model.packing import Packing


def mtp_targets(labels: torch.Tensor) -> torch.Tensor:
    """Main labels [B, T] (full rows) -> MTP labels [B, T]: label t+1 where label t is a
    target (token t+1 is in t's document), else -100; the last position has none."""
    nxt = torch.full_like(labels, IGNORE_INDEX)
    nxt[:, :-1] = torch.where(labels[:, :-1] != IGNORE_INDEX, labels[:, 1:], IGNORE_INDEX)
    return nxt


def stack_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] main labels -> [B, T, 2] (main, MTP): one tensor that layouts split along the
    sequence like the labels (tensor parallelism cuts rows after this, on full rows)."""
    return torch.stack([labels, mtp_targets(labels)], dim=-1)


def next_token_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """Token t+1 at position t [B, T]; the last position takes the row's first token (its
    MTP target is always -100, and causal attention within documents keeps it there)."""
    return torch.roll(input_ids, -1, dims=1)


class MTPModule(nn.Module):
    """The MTP module (module docstring); the embedding and LM head live in `K3Model`."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_res_blocks = [b - 1 for b in cfg.mtp_attn_res_blocks]  # 0-based snapshots
        self.enorm = RMSNorm(d, eps, device)
        self.hnorm = RMSNorm(d, eps, device)
        self.eh_proj = Linear(2 * d, d, bias=False, device=device)
        if self.attn_res_blocks:
            self.h_proj = Linear((len(self.attn_res_blocks) + 1) * d, d, bias=False,
                                    device=device)
        from model.decoder import DecoderLayer  # (model.decoder imports this module)

        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, device,
                                  layer_type=cfg.mtp_layer_type, moe=True, attn_res=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, eps, device)

    def forward(self, h: torch.Tensor, blocks: torch.Tensor, e_next: torch.Tensor,
                packing: Packing) -> torch.Tensor:
        """h [B, T, d] the main final state, blocks its AttnRes snapshots, e_next [B, T, d]
        the next tokens' embeddings -> the normalised MTP states [B, T, d] for the LM head."""
        if self.attn_res_blocks:
            h = self.h_proj(torch.cat([*blocks[self.attn_res_blocks], h], dim=-1))
        x = self.eh_proj(torch.cat([self.enorm(e_next), self.hnorm(h)], dim=-1))
        y, _ = self.layer(x, blocks[:0], packing)
        return self.shared_head.norm(y)

"""The K3 decoder: embedding, 93 (or fewer) hybrid layers with Block AttnRes, final mix, head,
and, with `num_nextn_predict_layers=1`, the MTP module (`model.mtp`) on the final state.

The AttnRes state is two tensors that flow from layer to layer (and, later, between pipeline
stages): `prefix` [B, T, d], the running sum of the current block, and `blocks` [n, B, T, d],
the frozen snapshots (embedding first). A layer that starts a block appends with `torch.cat`;
nothing is cached in module state. Layer flow (0-based idx, §3.3 / §8):

    h = mix_attn(prefix, blocks) if blocks else prefix
    if idx % block_size == 0: blocks += [prefix]; prefix = None
    prefix = attn(input_layernorm(h)) (+ prefix)
    h = mix_mlp(prefix, blocks); prefix += ffn(post_attention_layernorm(h))
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from model.attnres import mix
from model.config import ModelConfig
from model.kda import KimiDeltaAttention
from model.loss import chunked_cross_entropy
from model.mla import GatedMLA
from model.mlp import SiTUMLP
from model.moe import LatentMoE, apply_quantile_balancing
from model.mtp import MTPModule, mtp_targets, next_token_ids
from model.norms import RMSNorm
from model.packing import Packing


class DecoderLayer(nn.Module):
    """One hybrid layer. `layer_type` / `moe` override the config's schedule and
    `attn_res=False` makes a layer without AttnRes (the MTP layer: its state has no snapshots,
    so each mix would return its prefix; it has no mixing parameters and starts no block)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: torch.device | None = None,
                 layer_type: str | None = None, moe: bool | None = None,
                 attn_res: bool = True) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.layer_type = layer_type or cfg.layer_type(layer_idx)
        self.attn_res = attn_res
        self.starts_block = attn_res and layer_idx % cfg.attn_res_block_size == 0
        self.attn_res_eps = cfg.attn_res_eps
        self.self_attn = (GatedMLA(cfg, device) if self.layer_type == "mla"
                          else KimiDeltaAttention(cfg, device))
        if moe is None:
            moe = cfg.is_moe_layer(layer_idx)
        if moe:
            self.block_sparse_moe = LatentMoE(cfg, device)
        else:
            self.mlp = SiTUMLP(d, cfg.intermediate_size, cfg.activation_situ_beta,
                               cfg.activation_situ_linear_beta, device)
        self.input_layernorm = RMSNorm(d, eps, device)
        self.post_attention_layernorm = RMSNorm(d, eps, device)
        if not attn_res:
            return
        self.self_attention_res_norm = RMSNorm(d, eps, device)
        self.self_attention_res_proj = nn.Linear(d, 1, bias=False, device=device)
        self.mlp_res_norm = RMSNorm(d, eps, device)
        self.mlp_res_proj = nn.Linear(d, 1, bias=False, device=device)
        if layer_idx == 0:  # nothing to mix before the first layer: K3 ships this pair unused
            self.self_attention_res_norm.requires_grad_(False)
            self.self_attention_res_proj.requires_grad_(False)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, prefix: torch.Tensor, blocks: torch.Tensor, packing: Packing
                ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.attn_res_eps
        if not self.attn_res:  # a plain pre-norm residual layer
            prefix = prefix + self.self_attn(self.input_layernorm(prefix), packing)
            return prefix + self.ffn(self.post_attention_layernorm(prefix)), blocks
        if blocks.shape[0] > 0:
            h = mix(prefix, blocks, self.self_attention_res_norm, self.self_attention_res_proj, eps)
        else:
            h = prefix
        a = self.self_attn(self.input_layernorm(h), packing)
        if self.starts_block:
            blocks = torch.cat([blocks, prefix.unsqueeze(0)], dim=0)  # freeze the finished block
            prefix = a
        else:
            prefix = prefix + a
        h = mix(prefix, blocks, self.mlp_res_norm, self.mlp_res_proj, eps)
        prefix = prefix + self.ffn(self.post_attention_layernorm(h))
        return prefix, blocks


class K3Model(nn.Module):
    """Kimi K3 text backbone + untied LM head. Single device; parallelism is applied outside."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, device=device)
        # keyed by the global layer index, so a pipeline stage that keeps only some layers keeps
        # their names (and checkpoints load into any layout)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, device)
                                     for i in range(cfg.num_hidden_layers)})
        self.output_attn_res_norm = RMSNorm(d, cfg.rms_norm_eps, device)
        self.output_attn_res_proj = nn.Linear(d, 1, bias=False, device=device)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, device)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False, device=device)
        # multi-token prediction (model/mtp.py): uses embed_tokens and lm_head; each training
        # forward appends its (detached) MTP loss sum to `mtp_loss_sums` for the trainer's log
        self.mtp = MTPModule(cfg, device) if cfg.num_nextn_predict_layers else None
        self.mtp_loss_sums: list[torch.Tensor] = []
        # (h, head weight, labels, chunk) -> (loss sum, target count); tensor parallelism swaps
        # in the vocabulary-parallel version, like the MoE layer's dispatcher
        self.cross_entropy = functools.partial(chunked_cross_entropy,
                                               grads_in_forward=cfg.loss_grads_in_forward)
        # context parallelism (`parallel.context_parallel`): (rank, size) of this rank's slice
        # of every row; forwards then take whole rows of token ids (MTP embeds each slice's next
        # tokens, the last of which opens the next slice) and labels for the slice only
        self.context_shard: tuple[int, int] | None = None

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> the initial AttnRes state (prefix [B, T, d], blocks [0, B, T, d])."""
        prefix = self.embed_tokens(input_ids)
        return prefix, prefix.new_zeros((0, *prefix.shape))

    def run_layers(self, prefix: torch.Tensor, blocks: torch.Tensor, packing: Packing,
                   layer_ids: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the decoder layers `layer_ids` (default: all this module holds) in order."""
        for key in self.layers if layer_ids is None else layer_ids:
            prefix, blocks = self.layers[key](prefix, blocks, packing)
        return prefix, blocks

    def output_state(self, prefix: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The output AttnRes mix [B, T, d]: the final state (the MTP module's input)."""
        return mix(prefix, blocks, self.output_attn_res_norm, self.output_attn_res_proj,
                   self.config.attn_res_eps)

    def final_hidden(self, prefix: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The output AttnRes mix and final norm: the LM head's input [B, T, d]."""
        return self.norm(self.output_state(prefix, blocks))

    def hidden_states(self, input_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor | Packing | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final normalised hidden states [B, T, d].

        `cu_seqlens`: a prepared `Packing` (the trainer's: validated on the host, copied without
        blocking), or host boundaries [N+1], validated here before they move to the device."""
        packing = self.packing(input_ids, cu_seqlens)
        prefix, blocks = self.embed(packing.window(input_ids))
        prefix, blocks = self.run_layers(prefix, blocks, packing)
        return self.final_hidden(prefix, blocks)

    def packing(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | Packing | None
                ) -> Packing:
        """The boundaries of whole rows `input_ids` [B, T], as this rank's shard of them
        under context parallelism."""
        if isinstance(cu_seqlens, Packing):
            packing = cu_seqlens
        else:
            B, T = input_ids.shape
            if cu_seqlens is not None and cu_seqlens.device.type != "cpu":
                packing = Packing(B, T, input_ids.device, cu_seqlens)  # on the device: not read
            else:
                packing = Packing.from_host(cu_seqlens, B, T, input_ids.device)
        return self._shard(packing)

    def _shard(self, packing: Packing) -> Packing:
        if self.context_shard is None or packing.context is not None:
            return packing
        return packing.shard(*self.context_shard)

    def _embed_rows(self, input_ids: torch.Tensor, packing: Packing
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Whole rows of token ids -> this shard's (prefix, blocks, MTP's next-token
        embeddings or None)."""
        prefix, blocks = self.embed(packing.window(input_ids))
        # by the config, not `self.mtp`: a first pipeline stage embeds them for the last one
        e_next = (self.embed_tokens(packing.window(next_token_ids(input_ids)))
                  if self.config.num_nextn_predict_layers else None)
        return prefix, blocks, e_next

    def forward_stage(self, *inputs: torch.Tensor, cu_seqlens: torch.Tensor, seq_len: int,
                      max_seqlen: int | None = None, labels: torch.Tensor | None = None,
                      layer_ids: list[str] | None = None, first: bool = False,
                      last: bool = False):
        """One pipeline stage: (input_ids,) if `first` else (prefix, blocks) -> (prefix, blocks),
        or the loss sum if `last`. With MTP, (prefix, blocks, e_next) flow between stages: the
        first stage embeds the next tokens and every stage passes them on, so the embedding's
        gradient from the MTP module returns through the pipeline to it. Document boundaries
        come as `cu_seqlens` [1, W] on the device: this micro-batch's row of the step's
        boundaries, padded with empty trailing documents to one width (they split along dim 0
        like every other micro-batch tensor); `seq_len` is T (a stage's inputs hold T / tp
        tokens under sequence parallelism) and `max_seqlen` a host bound of the step's longest
        document."""
        packing = self._shard(Packing(inputs[0].shape[0], seq_len, cu_seqlens.device,
                                      cu_seqlens.reshape(-1), max_seqlen))
        if first:
            prefix, blocks, e_next = self._embed_rows(inputs[0], packing)
        else:
            prefix, blocks, *rest = inputs
            e_next = rest[0] if rest else None
        prefix, blocks = self.run_layers(prefix, blocks, packing, layer_ids)
        if not last:
            return (prefix, blocks) if e_next is None else (prefix, blocks, e_next)
        return self._loss(prefix, blocks, e_next, packing, labels)[0]

    def _loss(self, prefix: torch.Tensor, blocks: torch.Tensor, e_next: torch.Tensor | None,
              packing: Packing, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(main loss sum + mtp_loss_weight x MTP loss sum, main target count). `labels`:
        [B, T] main labels, or [B, T, 2] (main, MTP; `model.mtp.stack_targets`)."""
        main = labels[..., 0] if labels.ndim == 3 else labels
        h = self.output_state(prefix, blocks)
        total, n = self.loss_from_hidden(self.norm(h), main)
        if self.mtp is not None:
            targets = labels[..., 1] if labels.ndim == 3 else mtp_targets(labels)
            y = self.mtp(h, blocks, e_next, packing)
            s, _ = self.cross_entropy(y.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                      self.config.loss_chunk_tokens)
            self.mtp_loss_sums.append(s.detach())
            total = total + self.config.mtp_loss_weight * s
        return total, n

    def loss_from_hidden(self, h: torch.Tensor, labels: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, target-token count) of the LM head on final hidden states."""
        return self.cross_entropy(h.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                                  self.config.loss_chunk_tokens)

    def forward(self, input_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | Packing | None = None,
                labels: torch.Tensor | None = None):
        """Without labels: logits [B, T, vocab] (materialised; for inspection and tests).

        With labels: (sum of token cross-entropies, number of target tokens), labels -100
        ignored, computed over chunks of tokens; with MTP the sum adds mtp_loss_weight x the
        MTP loss sum (`_loss`; labels [B, T] full rows, or [B, T, 2] main and MTP targets).
        The sum, not the mean, so the trainer can divide by the global batch's token count.
        Training goes through here (not `loss` helpers) so that wrappers' forward hooks (FSDP)
        run.
        """
        packing = self.packing(input_ids, cu_seqlens)
        prefix, blocks, e_next = self._embed_rows(input_ids, packing)
        prefix, blocks = self.run_layers(prefix, blocks, packing)
        if labels is None:
            return self.lm_head(self.final_hidden(prefix, blocks))
        return self._loss(prefix, blocks, e_next, packing, labels)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, target-token count): `self(input_ids, cu_seqlens, labels)`."""
        return self(input_ids, cu_seqlens, labels=labels)

    def decoder_layers(self) -> list[DecoderLayer]:
        """This module's decoder layers in order, the MTP layer last (if held)."""
        mtp = [self.mtp.layer] if self.mtp is not None else []
        return [*self.layers.values(), *mtp]

    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    @torch.no_grad()
    def apply_quantile_balancing(self) -> None:
        """Between optimizer steps: update every router bias from its (reduced) histogram."""
        apply_quantile_balancing([moe.gate for moe in self.moe_layers()])

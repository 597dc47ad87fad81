"""ModelConfig: every field of Kimi K3's text config (k3-architecture.md §7.1) + training knobs.

Field names follow the Hugging Face `config.json` of K3 where one exists, so presets read like the
release. Presets live in `configs/model/<name>.yaml`; `load_model_config(name)` reads one.
Cross-field checks live in `ModelConfig.validate()` and raise one-line errors naming field and fix.
Parallel-layout checks (heads vs tp, ...) belong to `parallel/`, not here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"


class ConfigError(ValueError):
    """A bad config value; the message names the field and the fix."""


@dataclass
class ModelConfig:
    # --- backbone ---
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    # 1-based indices of the Gated-MLA layers; every other layer is KDA.
    full_attn_layers: list[int] = field(
        default_factory=lambda: [*range(4, 93, 4), 93]
    )
    # --- KDA (linear_attn_config) ---
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0  # None selects Kimi Linear's softplus gate
    kda_chunk_size: int = 64
    # --- Gated MLA ---
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_lora_norm_eps: float = 1e-6
    # --- MoE (Stable LatentMoE) ---
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584  # latent width
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792  # dense layer(s)
    moe_layer_freq: int = 1
    # --- activation (SiTU-GLU everywhere) ---
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # --- Block AttnRes ---
    attn_res_block_size: int = 12  # counted in decoder layers
    attn_res_eps: float = 1e-5
    # --- Quantile Balancing ---
    qb_num_bins: int = 1000
    # --- multi-token prediction (model/mtp.py; the release ships 0: its draft layer is separate)
    num_nextn_predict_layers: int = 0  # 0 or 1: one MTP module predicting token t+2
    mtp_loss_weight: float = 0.1  # the MTP loss's weight in the training objective
    mtp_layer_type: str = "mla"  # the MTP decoder layer's token mixer: "mla" or "kda"
    # 1-based AttnRes block snapshots fused with the final state into the MTP input through a
    # projection initialised to pass the final state only (K3's variant; [] = the final state)
    mtp_attn_res_blocks: list[int] = field(default_factory=list)
    # --- training-side knobs that change no weight ---
    loss_chunk_tokens: int = 4096  # tokens per LM-head chunk in the loss
    # the loss's input and head gradients formed in its forward from the logits it has (no
    # second logit GEMM in backward) and kept until backward: + [vocab, hidden] fp32 per
    # micro-batch in flight; false recomputes the logits in backward instead
    loss_grads_in_forward: bool = True

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def layer_type(self, layer_idx: int) -> str:
        """'mla' or 'kda' for a 0-based layer index."""
        return "mla" if (layer_idx + 1) in set(self.full_attn_layers) else "kda"

    @property
    def layer_types(self) -> list[str]:
        return [self.layer_type(i) for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @property
    def num_layers_with_mtp(self) -> int:
        """Decoder layers plus MTP layers: the MTP layer's index is num_hidden_layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def attn_res_snapshot_layers(self) -> list[int]:
        """0-based layers at whose start the running prefix is frozen into a block snapshot."""
        return list(range(0, self.num_hidden_layers, self.attn_res_block_size))

    # --------------------------------------------------------------- validation
    def validate(self) -> ModelConfig:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads",
                     "kda_head_dim", "num_attention_heads", "kv_lora_rank", "v_head_dim",
                     "num_experts", "num_experts_per_token", "moe_intermediate_size",
                     "routed_expert_hidden_size", "intermediate_size", "attn_res_block_size",
                     "short_conv_kernel_size", "kda_chunk_size", "qb_num_bins", "moe_layer_freq",
                     "loss_chunk_tokens"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"model.{name}={v!r} must be a positive integer")
        L = self.num_hidden_layers
        bad = [i for i in self.full_attn_layers if not 1 <= i <= L]
        need(not bad, f"model.full_attn_layers has {bad} outside 1..{L} (1-based layer indices)")
        need(len(set(self.full_attn_layers)) == len(self.full_attn_layers),
             "model.full_attn_layers has duplicates; list each MLA layer once")
        need(self.num_experts_per_token < self.num_experts,
             f"model.num_experts_per_token={self.num_experts_per_token} must be < "
             f"model.num_experts={self.num_experts} (Quantile Balancing needs a (k+1)-th score)")
        need(self.num_key_value_heads == self.num_attention_heads,
             "model.num_key_value_heads must equal model.num_attention_heads (K3 MLA has no GQA)")
        need(self.mla_use_nope, "model.mla_use_nope=false (RoPE MLA) is not supported; K3 is NoPE")
        need(self.hidden_act == "situ", f"model.hidden_act={self.hidden_act!r}: only 'situ'")
        need(self.moe_router_activation_func == "sigmoid",
             "model.moe_router_activation_func must be 'sigmoid' (K3's router)")
        need(self.num_expert_group == 1 and self.topk_group == 1,
             "model.num_expert_group/topk_group must be 1 (K3 uses no group-limited routing)")
        need(self.use_full_rank_gate, "model.use_full_rank_gate=false is unsupported (K3: true)")
        need(self.gate_lower_bound is None or -5.0 <= self.gate_lower_bound < 0,
             f"model.gate_lower_bound={self.gate_lower_bound} must be in [-5, 0) or null")
        need(0 <= self.first_k_dense_replace <= L,
             f"model.first_k_dense_replace={self.first_k_dense_replace} must be in 0..{L}")
        need(self.num_shared_experts >= 0, "model.num_shared_experts must be >= 0")
        need(self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0,
             "model.activation_situ_beta and activation_situ_linear_beta must be > 0")
        need(self.num_nextn_predict_layers in (0, 1),
             f"model.num_nextn_predict_layers={self.num_nextn_predict_layers} must be 0 or 1 "
             "(one MTP module, as K3 pretrains)")
        need(self.mtp_loss_weight >= 0,
             f"model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        need(self.mtp_layer_type in ("mla", "kda"),
             f"model.mtp_layer_type={self.mtp_layer_type!r} must be 'mla' or 'kda'")
        n_blocks = len(self.attn_res_snapshot_layers)
        bad = [b for b in self.mtp_attn_res_blocks if not 1 <= b <= n_blocks]
        need(not bad, f"model.mtp_attn_res_blocks has {bad} outside 1..{n_blocks} (1-based "
                      "AttnRes block snapshots; the embedding is block 1)")
        return self

    # ------------------------------------------------------------------- I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s) {unknown}; known fields: see "
                              "model/config.py ModelConfig")
        return cls(**d).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_model_config(name_or_path: str, **overrides: Any) -> ModelConfig:
    """Load a preset by name (`configs/model/<name>.yaml`) or from a YAML path."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"model preset {name_or_path!r} not found; choose one of "
                          f"{preset_names()} or give a path to a YAML file")
    data = yaml.safe_load(path.read_text()) or {}
    data.update(overrides)
    return ModelConfig.from_dict(data)

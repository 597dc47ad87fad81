"""Training FLOPs per token and model FLOPs utilisation (MFU) for a K3 config.

Counting convention (training = forward + backward = 3 x forward, 2 FLOPs per multiply-add):

    flops_per_token = 6 * N_active                                    (weights)
                    + sum over MLA layers of 3 * H * (d_qk + d_v) * T   (causal softmax attention)
                    + sum over KDA layers of 3 * H_kda * (6*d_k*d_v + 3*C*(d_k + d_v))

* N_active: `model.inspect.count_params(...)["active_params"]` of a meta-built model (input
  embedding excluded, LM head and router included, routed experts counted top-k/E). It also holds
  the few vector parameters (norm weights, gate biases, conv taps); they are < 0.01% of the total.
* MLA: per token and head, QK^T costs 2*d_qk and AV 2*d_v FLOPs per visible key; a causal
  sequence of length T sees T/2 keys on average, so the forward is H*(d_qk+d_v)*T and training
  3*H*(d_qk+d_v)*T. (torchtitan's 12*L*H*Q*T is the same count without the causal halving: our
  attention term is half of theirs.) With packed documents each document sees only its own
  keys: `step_flops(cfg, doc_lengths)` sums the attention term per document (sum of L^2), which
  is what the trainer's MFU and `benchmarks/roofline.py` use.
* KDA, chunked with chunk size C (`kda_chunk_size`, 64 in K3; capped at T), per token and head,
  forward: 6*d_k*d_v for the three state products (q S, w S, k^T v_new) and 3*C*(d_k + d_v) for
  the intra-chunk causal C x C products (A_qk, A_kk, w = A k on the key side; u = A v,
  o = A_qk v_new and the triangular solve / decay bookkeeping, counted as a third product, on the
  value side), each halved by causality. An estimate, not a kernel trace.
* MTP (`num_nextn_predict_layers=1`): its layer counts like a decoder layer of its type, its
  own matrices (eh_proj) are in N_active, and the shared LM head counts a second time (it runs
  on the MTP states too); the shared embedding is a lookup, as ever.
* Not counted: the AttnRes depth mixes (~7*d per source per mix per token, < 0.1% for K3),
  norms, activations, softmax and other elementwise work. MFU uses "model FLOPs": activation
  recomputation is never counted as useful work.

`peak_flops` is a table of dense bf16 peaks; CPUs have none (MFU is reported as null there).
"""

from __future__ import annotations

import functools
import json

import torch

from model.config import ModelConfig

# Dense (no 2:4 sparsity) bf16 tensor-core peaks per device, FLOP/s. First substring match wins,
# so longer names come first ("H200" before "H20", "H100 PCIE" before "H100").
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIE", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
]


@functools.lru_cache(maxsize=16)
def _active_params(cfg_json: str) -> int:
    from model.build import build_model
    from model.inspect import count_params

    cfg = ModelConfig.from_dict(json.loads(cfg_json))
    counts = count_params(build_model(cfg, device="meta"))
    head = cfg.vocab_size * cfg.hidden_size if cfg.num_nextn_predict_layers else 0
    return counts["active_params"] + counts["mtp_active_params"] + head


def active_params(cfg: ModelConfig) -> int:
    """Active matmul parameters per token, the MTP module's (and its second use of the LM head)
    included (cached per config; a K3 meta build takes ~2 s once)."""
    return _active_params(json.dumps(cfg.to_dict(), sort_keys=True))


def _layer_types(cfg: ModelConfig) -> list[str]:
    """Token-mixer type of every decoder layer, the MTP layer's last."""
    return cfg.layer_types + [cfg.mtp_layer_type] * cfg.num_nextn_predict_layers


def mla_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of one causal MLA layer's QK^T and AV products."""
    return 3.0 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len


def kda_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of one chunked-KDA layer's recurrence (see module docstring)."""
    d_k = d_v = cfg.kda_head_dim
    chunk = min(cfg.kda_chunk_size, seq_len)
    forward = 6.0 * d_k * d_v + 3.0 * chunk * (d_k + d_v)
    return 3.0 * cfg.kda_num_heads * forward


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive")
    types = _layer_types(cfg)
    return (6.0 * active_params(cfg)
            + types.count("mla") * mla_flops_per_token(cfg, seq_len)
            + types.count("kda") * kda_flops_per_token(cfg, seq_len))


def step_flops(cfg: ModelConfig, doc_lengths) -> float:
    """Training FLOPs of one batch of packed documents (lengths in tokens; any iterable of ints).

    Weights cost 6 * N_active per token whatever the packing, but attention and KDA see only
    their own document: a causal MLA layer over a document of length L costs
    3 * H * (d_qk + d_v) * L^2 (L tokens x L/2 visible keys on average), and KDA's chunk is
    capped at L. `flops_per_token(cfg, T) * B * T` is the special case of B documents of length T,
    so packed short documents are not credited with attention they never compute."""
    lengths = [int(n) for n in doc_lengths if int(n) > 0]
    if not lengths:
        return 0.0
    types = _layer_types(cfg)
    n_mla, n_kda = types.count("mla"), types.count("kda")
    tokens = sum(lengths)
    attn = sum(n * n for n in lengths) * (mla_flops_per_token(cfg, 1) if n_mla else 0.0)
    kda = sum(n * kda_flops_per_token(cfg, n) for n in lengths) if n_kda else 0.0
    return 6.0 * active_params(cfg) * tokens + n_mla * attn + n_kda * kda


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation as a fraction in [0, 1].

    Pass per-device throughput with a per-device peak (or global throughput with
    peak * world_size).
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops} must be positive")
    return tokens_per_sec * flops_per_token / peak_flops


def peak_flops_for_name(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a GPU name like 'NVIDIA H100 80GB HBM3'; None if unknown."""
    name = device_name.upper()
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak
    return None


def peak_flops(device: torch.device | str) -> float | None:
    """Dense bf16 peak FLOP/s of `device`; None on CPU or for a GPU missing from the table."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))

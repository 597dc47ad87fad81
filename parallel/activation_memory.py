"""Activation memory per rank and micro-batch: an analytic model of what each op keeps for backward.

The dry run (`launch/dryrun.py`) reports it at any size without running anything; it is checked
against fake-tensor traces of the same step (`tests/helpers/memory_trace.py`,
`tests/unit/test_activation_memory.py`: within 1% at up to 64K tokens, on one rank and under
tp 2, cp 2 and tp 2 x cp 2).

Every tensor is counted once, at the op that produces it, if a backward keeps it. What the GPU
kernels keep is what their custom ops' `setup_context` saves: fla's `chunk_kda` its inputs (q,
k, v, the gate pre-activation, beta's logits; it recomputes its chunk states in backward),
varlen attention q, k, v, o and the fp32 log-sum-exp, grouped GEMMs their operands (the
gathered token rows), the fused norms their input and fp32 1/rms, SiTU its two inputs, the
AttnRes mix its sources and fp32 per-source statistics. Plain linears keep their input. Token
counts per rank: S = B x T / cp inside tensor-parallel regions (attention, dense MLP, shared
experts: their input is all-gathered over tp), s = S / tp outside them (norms, AttnRes, the
router and routed experts); heads and MLP columns divide by tp. Routed experts receive s x k
rows (balanced: MoonEP's replicas even the load); with replicas each MoE layer also keeps the
[2 x E/ep] gathered expert weights its GEMMs saved. The chunked loss (main head and MTP's)
keeps its input and labels, or, with `model.loss_grads_in_forward` on one tp rank, the
gradients it formed in forward: d hidden [S, d] and d head [V, d], fp32.

`activation_checkpoint`: `none` keeps everything above; `full` keeps each layer's output (the
next layer's input) and the AttnRes snapshots, and recomputes one layer at a time in backward;
`selective` keeps the layer's inputs and the outputs of the ops `parallel.activation_checkpoint`
saves (GEMMs, grouped GEMMs, KDA, attention, collectives). `working` is the backward's extra
peak on top of what is kept (an estimate, not traced): the recomputed layer's own set (with
checkpointing), fla's recomputed chunk states [T/64, H, K, V] fp32, the gradient of the AttnRes
state, and one chunk of fp32 logits in the loss. Parameter gradients are not activations (the
dry run's state bytes hold them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from model.config import ModelConfig

F32 = 4


@dataclass(frozen=True)
class Shard:
    """One rank's share of a micro-batch: `tokens` = B x T / cp (S), its `batch` rows and
    `docs` documents (the varlen boundaries' count), `tp`, `cp`, `ep` and whether MoonEP
    fetches expert replicas; `act` bytes per activation element (2: bf16)."""

    tokens: int
    batch: int = 1
    docs: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    replicas: bool = True
    act: int = 2

    @property
    def seq(self) -> int:  # s: tokens outside tensor-parallel regions
        return self.tokens // self.tp


@dataclass(frozen=True)
class Term:
    """`bytes` of one tensor (or a group of alike tensors); `plain`: a backward keeps it
    without checkpointing; `selective`: selective checkpointing keeps it (an output of an op
    it saves)."""

    name: str
    bytes: int
    plain: bool = True
    selective: bool = False


def _kda(cfg: ModelConfig, sh: Shard) -> list[Term]:
    S, a, D = sh.tokens, sh.act, cfg.kda_head_dim
    HD = cfg.kda_num_heads // sh.tp * D
    H = cfg.kda_num_heads // sh.tp
    terms = [
        Term("kda.qkv_proj_out", 3 * S * HD * a, selective=True),  # short conv inputs
        Term("kda.qkv_conv_out", 3 * S * HD * a),  # the KDA op's q, k, v
        Term("kda.f_a_out", S * D * a, selective=True),
        Term("kda.f_b_out", S * HD * a, selective=True),  # gate pre-activation
        Term("kda.beta_logits", S * H * a, selective=True),
        Term("kda.out", S * HD * a, selective=True),  # o: the gated norm's input
        Term("kda.g_proj_out", S * HD * a, selective=True),  # the norm's gate
        Term("kda.o_norm_rstd", S * H * F32),
        Term("kda.o_norm_out", S * HD * a),  # o_proj's input
        Term("kda.o_proj_out", S * cfg.hidden_size * a, plain=False, selective=True),
    ]
    if sh.cp > 1:  # KCP (model.ops.kda_context), K = V = D per head, fp32 states
        terms.append(Term("kda.kcp_wide_v", S * H * 2 * D * a, selective=True))
        terms.append(Term("kda.kcp_cross", S * HD * a))  # o_wide's M part, for the correction
        state, wide = H * D * D * F32, H * D * 2 * D * F32
        # per-document initial states (zeros but for each row's entering document), each
        # row's [0 | I] start, the gathered maps, the composition's states
        states = ((sh.docs + sh.batch + sh.cp * sh.batch) * wide
                  + (sh.cp + 1) * sh.batch * state)
        terms.append(Term("kda.kcp_states", states, selective=True))
    return terms


def _mla(cfg: ModelConfig, sh: Shard) -> list[Term]:
    S, a = sh.tokens, sh.act
    H = cfg.num_attention_heads // sh.tp
    qk, vd, nope = cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_nope_head_dim
    ql, kvl = cfg.q_lora_rank or 0, cfg.kv_lora_rank
    # without context parallelism attention keeps v as a view of kv_b's [k_C | v] output;
    # Ulysses' all-to-all gives it v alone
    v_kept = H * ((nope + vd) if sh.cp == 1 else vd)
    terms = [
        Term("mla.q_a_out", S * ql * a, selective=True),
        Term("mla.q_a_norm", S * ql * a + S * F32),
        Term("mla.kv_a_out", S * (kvl + cfg.qk_rope_head_dim) * a, plain=False,
             selective=True),
        Term("mla.c_kv", S * kvl * a),  # a contiguous copy for its norm
        Term("mla.kv_a_norm", S * kvl * a + S * F32),
        Term("mla.q", S * H * qk * a, selective=True),
        Term("mla.k", S * H * qk * a),  # [k_C | k_R] concatenated
        Term("mla.v", S * v_kept * a, selective=True),
        Term("mla.attn_out", S * H * vd * a + H * S * F32, selective=True),  # o and its LSE
        Term("mla.gate_fp32", 2 * S * H * vd * F32),  # fp32 o and sigmoid(g)
        Term("mla.g_proj_out", S * H * vd * a, plain=False, selective=True),
        Term("mla.o_proj_in", S * H * vd * a),
        Term("mla.o_proj_out", S * cfg.hidden_size * a, plain=False, selective=True),
    ]
    if ql == 0:  # a full-rank q projection
        terms = [t for t in terms if not t.name.startswith("mla.q_a")]
    return terms


def _glu(name: str, S: int, width: int, d: int, a: int) -> list[Term]:
    """A SiTU-GLU MLP on S tokens of `width` columns: gate and up outputs, SiTU's output."""
    return [Term(f"{name}.gate_up_out", 2 * S * width * a, selective=True),
            Term(f"{name}.situ_out", S * width * a),
            Term(f"{name}.down_out", S * d * a, plain=False, selective=True)]


def _moe(cfg: ModelConfig, sh: Shard) -> list[Term]:
    s, S, a, d = sh.seq, sh.tokens, sh.act, cfg.hidden_size
    E, k, lat, m = (cfg.num_experts, cfg.num_experts_per_token, cfg.routed_expert_hidden_size,
                    cfg.moe_intermediate_size)
    rows = s * k
    terms = [
        Term("moe.router_in_fp32", s * d * F32),
        Term("moe.router_weight_fp32", E * d * F32),
        Term("moe.router_scores", s * E * F32, selective=True),  # the GEMM's output
        Term("moe.routing", s * k * (8 + 2 * F32) + s * F32 + 2 * rows * 8),
        Term("moe.latent_in", s * lat * a, plain=False, selective=True),
        Term("moe.rows_in", rows * lat * a),  # grouped GEMM operand (gathered rows)
        Term("moe.rows_gate_up", 2 * rows * m * a, selective=True),
        Term("moe.rows_situ", rows * m * a),
        Term("moe.rows_out", rows * lat * a, selective=True),  # the combine's input
        Term("moe.combined_fp32", s * lat * F32 + s * F32),  # the latent norm's input
        Term("moe.up_in", s * lat * a),
        Term("moe.up_out", s * d * a, plain=False, selective=True),
    ]
    if sh.ep > 1 and sh.replicas:  # home | replica slots gathered for the GEMMs
        terms.append(Term("moe.expert_weights", 2 * E // sh.ep * 3 * m * lat * a,
                          selective=True))
    if cfg.num_shared_experts:
        width = cfg.num_shared_experts * m // sh.tp
        if sh.tp > 1:  # its own all-gathered input
            terms.append(Term("moe.shared_in", S * d * a, selective=True))
        terms += _glu("moe.shared", S, width, d, a)
    return terms


def layer_terms(cfg: ModelConfig, sh: Shard, layer_type: str, moe: bool, blocks_in: int,
                starts_block: bool, attn_res: bool = True) -> list[Term]:
    """What one decoder layer keeps, its output included (the next consumer's input).
    `blocks_in`: AttnRes snapshots it receives."""
    s, S, a, d = sh.seq, sh.tokens, sh.act, cfg.hidden_size
    terms: list[Term] = []
    if attn_res and blocks_in > 0:  # the attention site's mix: output + per-source stats
        terms.append(Term("attnres.mix_attn", s * d * a + 2 * (blocks_in + 1) * s * F32))
    terms.append(Term("input_norm_rstd", s * F32))
    terms.append(Term("attn_in", S * d * a, selective=sh.tp > 1))  # gathered over tp
    terms += _mla(cfg, sh) if layer_type == "mla" else _kda(cfg, sh)
    if sh.tp > 1:
        terms.append(Term("attn_out_scattered", s * d * a, plain=False, selective=True))
    blocks_mid = blocks_in + (1 if starts_block else 0)
    if starts_block:  # torch.cat of the snapshots: a new tensor with every block so far
        terms.append(Term("attnres.blocks", blocks_mid * s * d * a))
    terms.append(Term("attn_residual", s * d * a))  # the prefix the FFN mix reads
    if attn_res:
        terms.append(Term("attnres.mix_mlp", s * d * a + 2 * (blocks_mid + 1) * s * F32))
    terms.append(Term("post_norm_rstd", s * F32))
    if moe:
        terms.append(Term("ffn_in", s * d * a))
        terms += _moe(cfg, sh)
    else:
        terms.append(Term("ffn_in", S * d * a, selective=sh.tp > 1))
        terms += _glu("mlp", S, cfg.intermediate_size // sh.tp, d, a)
    if sh.tp > 1:
        terms.append(Term("ffn_out_scattered", s * d * a, plain=False, selective=True))
    terms.append(Term("output", s * d * a))
    return terms


def _kept(terms: list[Term], ac: str) -> int:
    if ac == "none":
        return sum(t.bytes for t in terms if t.plain)
    # checkpointing keeps the layer's outputs: the new prefix and a new snapshot stack
    out = sum(t.bytes for t in terms if t.name in ("output", "attnres.blocks"))
    if ac == "full":
        return out
    return out + sum(t.bytes for t in terms if t.selective)


def _loss_terms(cfg: ModelConfig, sh: Shard, blocks: int) -> list[Term]:
    """The output mix, final norm and LM head's chunked loss (and the MTP module)."""
    s, S, a, d = sh.seq, sh.tokens, sh.act, cfg.hidden_size
    # the chunked loss (model.loss) keeps its input and labels, or, with its gradients formed
    # in forward (one rank of tp; the vocabulary-parallel head recomputes), d hidden and d head
    # in fp32, for the main head and for MTP's
    early = cfg.loss_grads_in_forward and sh.tp == 1
    head = (Term("head_grads", S * d * F32 + cfg.vocab_size * d * F32) if early
            else Term("head_in", S * d * a))  # gathered over tp for the vocabulary-parallel head
    terms = [Term("output_mix", s * d * a + 2 * (blocks + 1) * s * F32),
             Term("final_norm", s * F32), head]
    if not early:
        terms.append(Term("labels", 2 * S * 8))
    if cfg.num_nextn_predict_layers:
        terms += [Term("mtp.e_next", s * d * a),
                  Term("mtp.norms_rstd", 2 * s * F32),
                  Term("mtp.eh_in", s * 2 * d * a),  # the normed [e_next | h] eh_proj keeps
                  Term("mtp.eh_out", s * d * a),  # the MTP layer's input
                  Term("mtp.head_norm", s * F32),
                  dataclasses.replace(head, name="mtp." + head.name)]
        if cfg.mtp_attn_res_blocks:  # h_proj over [chosen snapshots | h], its output normed
            n = len(cfg.mtp_attn_res_blocks) + 1
            terms += [Term("mtp.h_proj_in", n * s * d * a), Term("mtp.h_proj_out", s * d * a)]
    return terms


@dataclass(frozen=True)
class StageMemory:
    kept: int  # bytes kept for backward when the stage's forward ends
    working: int  # the backward's extra peak (estimate)


def stage_memory(cfg: ModelConfig, sh: Shard, layers: list[int], ac: str = "none",
                 first: bool = True, last: bool = True) -> StageMemory:
    """Activation bytes of one micro-batch on one rank running decoder layers `layers` (the
    first stage also embeds; the last adds the output mix, loss and MTP)."""
    s, a, d = sh.seq, sh.act, cfg.hidden_size
    kept = 0

    def add(terms: list[Term], mode: str) -> None:
        nonlocal kept
        kept += _kept(terms, mode)

    block = cfg.attn_res_block_size
    if first:
        add([Term("embedding", s * d * a)], "none")
    elif layers:  # the previous stage's prefix and snapshots (and MTP's next-token embeddings)
        n_in = 1 + -(-layers[0] // block) + (1 if cfg.num_nextn_predict_layers else 0)
        add([Term("stage_in", n_in * s * d * a)], "none")
    largest = 0
    for i in layers:
        terms = layer_terms(cfg, sh, cfg.layer_type(i), cfg.is_moe_layer(i),
                            blocks_in=-(-i // block), starts_block=i % block == 0)
        largest = max(largest, sum(t.bytes for t in terms if t.plain))
        add(terms, ac)
    blocks = -(-cfg.num_hidden_layers // block)
    if last:
        add(_loss_terms(cfg, sh, blocks), "none")
        if cfg.num_nextn_predict_layers:
            terms = layer_terms(cfg, sh, cfg.mtp_layer_type, True, 0, False, attn_res=False)
            largest = max(largest, sum(t.bytes for t in terms if t.plain))
            add(terms, ac)
    H, K = cfg.kda_num_heads // sh.tp, cfg.kda_head_dim
    fla_states = math.ceil(sh.tokens / cfg.kda_chunk_size) * H * K * K * F32
    loss_chunk = 2 * min(cfg.loss_chunk_tokens, sh.tokens) * cfg.vocab_size // sh.tp * F32
    working = ((largest if ac != "none" else 0) + fla_states + (blocks + 1) * s * d * a
               + (loss_chunk if last else 0))
    return StageMemory(kept, working)


def micro_batches_in_flight(schedule: str | None, pp: int, pp_rank: int, n_micro: int,
                            stages_per_rank: int = 1) -> float:
    """How many micro-batches' worth of this rank's activations are alive at once: those whose
    forward has run and backward has not, at the schedule's first backward (torch.distributed.
    pipelining's orders; interleaved ranks count stage chunks, each 1/v of the rank's layers).
    Zero-bubble schedules also hold weight-gradient inputs a little longer: not counted."""
    v = stages_per_rank
    if pp == 1:
        return 1.0
    if schedule in ("GPipe", "LoopedBFS"):  # every forward before any backward
        return float(n_micro)
    if schedule == "1F1B":
        return float(min(n_micro, pp - pp_rank))
    if schedule == "ZBVZeroBubble":  # 2 pp chunk forwards before the first backward, any rank
        return min(2 * n_micro, 2 * pp) / 2
    factor = 2 if schedule == "Interleaved1F1B" else 1  # InterleavedZeroBubble
    warmup = (v - 1) * pp + factor * (pp - 1 - pp_rank)
    return min(n_micro * v, warmup + 1) / v

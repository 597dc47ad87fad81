"""Roofline prediction of one GPU training step from the real op graph, traced on a CPU.

    python benchmarks/roofline.py [hydra overrides] --gpu h200|h100|b200 [--table] [--layer N]
        [--world N] [--optimizer-shards N] [--compiled] [--unfused all|NAMES]
    e.g. model=k3_small data.seq_len=4096 data.micro_batch=1 data.docs_per_row=4
         parallel.tp=2 parallel.ep=4 --world 8      (layout: communication volume only)
         model=k3_small data.seq_len=4096 data.micro_batch=1 data.global_batch=16 --world 1
         parallel.reshard_after_forward=false --compiled     (one GPU, 16 micro-batches)

Prints ONE JSON line (the last line on stdout); `--table` first prints the top 20 ops by
predicted time to stderr. Python API: `roofline(overrides, gpu=, layer=, world=,
optimizer_shards=) -> dict`, `analyze(...) -> (dict, op records)`, and `trace_ops(fn, ...)` /
`op_time(...)` for the pieces; `replay=True` (analyze, trace_ops) keeps on each record how to run
it again (`Replay`: the overload, tensor arguments as shape/stride/dtype; the GPU suite's stage
i_ops times the top ones). JSON: tokens, model_flops, traced_flops (flop_counter + custom-op
formulas), vector_flops, predicted_step_s, predicted_mfu, fwd_bwd_s / fwd_bwd_mfu (forward +
backward only; fwd_bwd_kernels / fwd_bwd_bytes their kernels and HBM bytes), kernels,
by_category {name: {s, flops, bytes, kernels, vector_flops}},
by_phase, non_gemm_fraction (time outside gemm/attention/kda over the total), comm_bytes by
dim (+ comm_detail), layout, gpu, preset, layer, seq_len, micro_batch, micro_batches,
global_batch, doc_lengths, constants.

What is traced. The job config is composed and validated by the launcher's own code
(`launch.pretrain.compose_job`, `train.config.validate_job`; configs/, `+cluster=gpu_node8`
unless a cluster is given: bf16 parameters as FSDP2's mixed precision casts them, fp32 gradient
reduction), without its device check. One step = the trainer's
N = data.global_batch / (dp x data.micro_batch) micro-batches on this rank (JSON
`micro_batches`, dp from the layout over `--world`), each `[data.micro_batch, data.seq_len]` of
packed documents (`data.docs_per_row`, our knob, default 4 per row; document i of a row is about
(i+1)/sum(1..n) of it, so lengths are uneven) through forward and backward (traced once,
counted N times: `OpRecord.count`), then once gradient clipping
(`parallel.grads.clip_grad_norm`), the AdamW step (`train.optim.build.build_optimizer`: torch's
fused AdamW, its CUDA choice) and the router-bias update (Quantile Balancing, phase `step_end`).
`tokens` and `model_flops` are the step's (N micro-batches); `doc_lengths` one micro-batch's.
`--layer N` traces decoder layer N alone (AttnRes inputs of the right depth, like
tests/unit/test_gpu_ready.py's `_k3_layer_step`) plus its parameters' optimizer step: needed for
the full `k3`, whose whole step is too large to trace.

* Forward and backward run under `FakeTensorMode` on CPU-device fake tensors (bf16 parameters
  and activations) inside `model.ops.backends.force_cuda_backends()`, so every op takes its
  CUDA path: `k3::chunk_kda_fla`, `k3::varlen_attention`, `k3::grouped_mm` and their
  backwards are single opaque ops, and the loss's logits are one bf16 GEMM writing fp32
  (`model.loss.mm_fp32_out`, `torch.mm(out_dtype=)`).
* The optimizer runs for real on fake fp32 master parameters with fp32 gradients: the one
  `train.optim.build.build_optimizer` builds on CUDA, torch's fused AdamW (`aten._fused_adamw_`, as
  many multi_tensor_apply launches as foreach ops), its state initialised by one unrecorded step
  (the CPU step counters it keeps are host ops, not kernels). `clip_grad_norm`'s final float()
  read cannot run on fake tensors: it is the last statement, so every kernel before it is
  recorded. FSDP2's mixed-precision copies are added analytically,
  one kernel each per unit (each decoder layer, the root) and all-gather (2 per micro-batch; 1
  for the last layer and the root, kept gathered; with `parallel.reshard_after_forward=false`
  or pp > 1, 1 per unit per step): `fsdp.all_gather_copy_in` (fp32 shard -> bf16 buffer, 6 B
  per shard element), `fsdp.all_gather_copy_out` (4 B per parameter) and
  `fsdp.reduce_scatter_copy_in` (gradient -> fp32 buffer, once: 6 B per parameter from bf16,
  8 B from the accumulator); with N > 1 FSDP2's fp32 gradient accumulation,
  `fsdp.grad_to_fp32` (6 B per parameter, once) and `fsdp.grad_accumulate` (10 B, N - 1 times),
  a kernel per parameter tensor.
  `--optimizer-shards N` (default 1: the whole optimizer on this GPU, as in the one-GPU step of
  benchmarks/gpu_suite.sh stage f) runs the optimizer and the copy-in on one rank's FSDP2 dim-0
  shard of N. Forward and backward are always the full micro-batch on one GPU.
* A TorchDispatchMode inside the fake mode records each op: FLOPs from
  `torch.utils.flop_counter.flop_registry` (mm, addmm, bmm, SDPA, ...) or our formulas for the
  custom ops (below); bytes = sum of the input and output tensor bytes (expanded dims counted
  once; in-place and foreach ops count the mutated tensors as written; gather-like ops
  (embedding, index, gather, index_select) and in-place scatters (index_put_, scatter_add_)
  count the rows they touch, not the whole table; copy_/fill_/zero_ do not read their
  destination); views and metadata ops (view, reshape, expand, t, detach, empty, ...) cost 0
  and count no kernel; ops on host tensors only are dropped.
* Custom-op formulas (executed FLOPs, per document L from the host lengths built here; the
  device `cu_seqlens` is a fake tensor): `k3::varlen_attention` 2*H*sum(L(L+1)/2)*(Dqk + Dpad),
  backward 2*H*sum(L(L+1)/2)*(3*Dqk + 2*Dpad) (flop_counter's SDPA-backward count, causal),
  Dpad = max(Dqk, Dv) since the kernel runs v zero-padded to Dqk; `k3::chunk_kda_fla`
  H*sum(L*(6*K*V + 3*min(C, L)*(K + V))) (train.observe.flops' KDA count), `k3::chunk_kda_fla_bwd`
  3x that (fla's backward ~2x forward, plus the forward it re-runs); `k3::grouped_mm` and
  `k3::grouped_mm_wgrad` 2*rows*in*out. Kernels per op: 1, except KDA forward 6 and backward 16
  (fla 0.6 chunk_kda: cumsum, intra, solve, w/u, h, o; the backward re-runs the forward, then
  ~10 more; +3 forward and +9 backward with KDA's prologue in fla, `KDA_PROLOGUE_KERNELS`),
  varlen forward 3 (v pad, FlashAttention, output slice) and backward 8 (3 pads, rng
  zeros, 3 FlashAttention-backward kernels, slice), foreach ops as CUDA's multi_tensor_apply
  launches them (<= 110/64/48/36/30 tensors for 1-5 lists, <= 320 blocks of 65536 elements).
  Non-GEMM ops get 1 FLOP per element (`vector_flops`, reported apart from `traced_flops`).
* Predicted time of an op: max(FLOPs / rate, bytes / bandwidth) + 5 us per kernel; rate = the
  GEMM rate for matmul-like ops (mm, addmm, bmm, grouped GEMMs, _scaled_mm, attention, KDA),
  the vector rate otherwise, and for GEMMs of fp32 operands too (the router's: torch's CUDA
  default keeps TF32 off, so they run on CUDA cores; `OpRecord.fp32_gemm`). No overlap
  between ops and no communication time: a lower bound on a step that runs kernels back to
  back, on one GPU, in eager mode (the op graph is traced without torch.compile, so no
  elementwise fusion). `--compiled` models `parallel.compile=true`
  instead: each decoder layer's glue as the fused kernels inductor's scheduler makes of it
  (benchmarks/roofline_compiled.py; JSON `compiled_graphs`, `unmatched_externs`).
* `--unfused all|NAMES` (JSON `unfused`) costs the named fused kernels (`FUSED_OPS`: situ_glu,
  row_norm, attnres_mix, short_conv, moe_combine, ce_logit_grad, record_router_stats, mx_cast;
  a name takes its backward along) as the ops of their PyTorch form, traced through the custom
  op's body: the before/after of each kernel.
* MFU = model_flops / (predicted_step_s * dense bf16 peak), model_flops =
  `train.observe.flops.step_flops(cfg, doc_lengths)` (the trainer's count). With `--layer N`, the
  same count restricted to the layer: 6 * its active parameters (routed experts top-k/E) per token
  plus its own MLA or KDA term (train.observe.flops.mla/kda_flops_per_token, per document); the sum
  over all layers plus the head, output mix and final norm is `step_flops` (tested).

Categories (documented rule, first match wins): (1) the op: matmul-like -> gemm, attention
kernels -> attention, KDA kernels -> kda; (2) the optimizer phase -> optimizer; (3) the
innermost Python frame in `model/`: attnres.py / ops/attnres.py and the block-snapshot `cat`
in decoder.py -> attnres; Router.* in moe.py, dispatch.py, balancing.py, ops/grouped_gemm.py
glue, ops/combine.py -> moe_routing; loss.py, ops/ce_grad.py -> loss; ops/attention.py glue
-> attention; ops/kda.py glue -> kda; anything else in model/ (norms, short convs, SiTU, gates,
residual adds, casts, the embedding) -> elementwise_norm; (4) in backward, ops of C++ autograd nodes
have no model frame:
a TorchFunctionMode tags, during forward, each autograd node a torch call creates (its output's
`grad_fn` and the new nodes behind it) in `Node.metadata` with the category of the call site,
and the recorder reads `torch._C._current_autograd_node()`; Python backwards (the chunked loss,
the custom ops' backward functions) have frames and use rule (3); (5) else elementwise_norm.
Limits: a node is attributed to the torch call that created it (a composite call's inner nodes
go with it); gradient accumulation adds done by the autograd engine between nodes take the
category of the node being run; `torch.autograd.Function.apply` is not seen by the function
mode (its backward has Python frames, so rule (3) applies).

Communication (`comm_bytes`, analytic, bytes each rank sends per step = per predicted step, the
busiest rank where ranks differ; the trace itself is one device; activation terms x N
micro-batches): `dp_shard` FSDP all-gathers of bf16 parameters (2 per micro-batch; 1 per step
under pp or with reshard_after_forward=false) and reduce-scatter of fp32 gradients, (n-1)/n of each
rank's stage and tp shard; experts under ep are FSDP'd over edp = dp_shard*tp/ep; `dp_replicate`
all-reduce (2(r-1)/r) of the fp32 gradient shards; `tp` one all-gather + one reduce-scatter of
[B, T, d] bf16 activations per TP region (token mixer, dense MLP or shared experts; the
vocabulary-parallel embedding and head) forward, the same backward, plus the all-reduce of
tp-replicated fp32 gradients; `pp` the AttnRes state (prefix + block snapshots, [B, T/tp, d]
each) at each stage boundary forward and its gradient backward, layers split evenly;
`ep` all-to-all token bytes 2 (dispatch + combine) x tokens/tp x topk x latent x 2 B x
(ep-1)/ep per MoE layer forward and the same backward (`ep_replica_weights_max`: every replica
slot filled, bf16 w1|w3|w2 fetched forward and their gradients sent home backward). Layout:
`parallel.*` overrides over `--world` ranks (default 8: one gpu_node8 node).

Constants below change only from measurements of benchmarks/gpu_suite.sh (none yet).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,  # noqa: E402
)
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402

if str(ROOT / "benchmarks") not in sys.path:  # the module next to this one, however it loads
    sys.path.insert(0, str(ROOT / "benchmarks"))
from roofline_compiled import CompiledRegions  # noqa: E402


# ----------------------------------------------------------------------------- constants
@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    gemm_flops: float  # achievable dense bf16 GEMM rate, FLOP/s
    bandwidth: float  # achievable HBM bandwidth, B/s
    vector_flops: float  # non-tensor-core (CUDA-core fp32) rate, FLOP/s
    peak_bf16: float  # dense bf16 datasheet peak, for MFU (train.observe.flops.PEAK_BF16_FLOPS)


# Change only from measurements of benchmarks/gpu_suite.sh. Vector rate: the CUDA-core fp32
# datasheet rate (H100/H200 SXM 67 TFLOP/s, B200 80 TFLOP/s), ~1/15 of dense bf16 on Hopper.
GPUS: dict[str, GPU] = {
    "h200": GPU("H200", 790e12, 4.3e12, 67e12, 989e12),
    "h100": GPU("H100", 740e12, 3.0e12, 67e12, 989e12),
    "b200": GPU("B200", 1.8e15, 7.2e12, 80e12, 2250e12),
}
KERNEL_OVERHEAD_S = 5e-6  # per kernel launch (launch + tail), added to every op's roofline time

CATEGORIES = ("gemm", "attention", "kda", "elementwise_norm", "attnres", "moe_routing", "loss",
              "optimizer")
COMPUTE_CATEGORIES = ("gemm", "attention", "kda")  # the rest is `non_gemm_fraction`

GEMM_OPS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm",
            "aten._grouped_mm", "aten._scaled_grouped_mm", "k3.grouped_mm",
            "k3.grouped_mm_wgrad", "k3.wgrad_accumulate", "k3.grouped_wgrad_accumulate",
            "aten.convolution", "aten.convolution_backward"}
ATTENTION_OPS = {"k3.varlen_attention", "k3.varlen_attention_backward",
                 "aten._scaled_dot_product_flash_attention",
                 "aten._scaled_dot_product_flash_attention_backward",
                 "aten._scaled_dot_product_efficient_attention",
                 "aten._scaled_dot_product_efficient_attention_backward",
                 "aten._scaled_dot_product_cudnn_attention",
                 "aten._scaled_dot_product_cudnn_attention_backward",
                 "aten._flash_attention_forward", "aten._flash_attention_backward",
                 "aten._efficient_attention_forward", "aten._efficient_attention_backward"}
KDA_OPS = {"k3.chunk_kda_fla", "k3.chunk_kda_fla_bwd"}
MATMUL_OPS = GEMM_OPS | ATTENTION_OPS | KDA_OPS
# custom ops over library kernels, costed by formula; other k3:: ops are traced through
FORMULA_OPS = {"k3.grouped_mm", "k3.grouped_mm_wgrad", "k3.wgrad_accumulate",
               "k3.grouped_wgrad_accumulate", "k3.varlen_attention",
               "k3.varlen_attention_backward", "k3.chunk_kda_fla", "k3.chunk_kda_fla_bwd"}
# our fused kernels (one launch each unless KERNELS says; bytes = inputs + outputs, 1 vector FLOP
# per element)
FUSED_OPS = {"k3.attnres_mix", "k3.attnres_mix_bwd", "k3.situ_glu", "k3.situ_glu_bwd",
             "k3.short_conv", "k3.short_conv_bwd", "k3.row_norm", "k3.row_norm_bwd",
             "k3.moe_combine", "k3.moe_combine_bwd", "k3.mx_cast", "k3.ce_logit_grad",
             "k3.record_router_stats"}
KERNELS = {"k3.chunk_kda_fla": 6, "k3.chunk_kda_fla_bwd": 16, "k3.varlen_attention": 3,
           "k3.varlen_attention_backward": 8,
           "k3.record_router_stats": 4}  # scratch zeros, the kernel, two adds into the buffers
# KDA's prologue in fla (the ops' last argument, gate_in_kernel): forward 2 l2norm kernels and
# beta's sigmoid (the gate activation rides the chunk cumsum); the backward re-runs those 3, then
# the l2norm / sigmoid backwards (3) and the gate backward with its dA_log / ddt_bias sums (3)
KDA_PROLOGUE_KERNELS = {"k3.chunk_kda_fla": 3, "k3.chunk_kda_fla_bwd": 9}

# no kernel, no bytes: views, metadata and allocation
NO_KERNEL_OPS = {
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten._reshape_alias", "aten.expand",
    "aten.t", "aten.transpose", "aten.permute", "aten.squeeze", "aten.unsqueeze", "aten.select",
    "aten.slice", "aten.narrow", "aten.split", "aten.split_with_sizes", "aten.unbind",
    "aten.chunk", "aten.diagonal", "aten.as_strided", "aten.alias", "aten.detach",
    "aten.lift_fresh", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.unfold", "aten.view_as_real", "aten.view_as_complex",
    "aten.is_same_size", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
    "aten.sym_storage_offset", "aten.set_", "aten.resize_", "aten._local_scalar_dense",
    "prim.device", "prim.layout",
}
WRITE_ONLY_OPS = {"aten.copy_", "aten.fill_", "aten.zero_", "aten._foreach_copy_",
                  "aten._foreach_zero_", "aten.normal_", "aten.uniform_"}
GATHER_OPS = {"aten.embedding", "aten.index", "aten.gather", "aten.index_select"}
SCATTER_INPLACE_OPS = {"aten.index_put_", "aten._index_put_impl_", "aten.scatter_add_",
                       "aten.scatter_", "aten.scatter_reduce_", "aten.index_add_"}
# CUDA multi_tensor_apply: tensors per launch by number of tensor lists; blocks per launch
FOREACH_MAX_TENSORS = (110, 64, 48, 36, 30)
FOREACH_MAX_BLOCKS, FOREACH_CHUNK = 320, 65536

MODEL_DIR = str(ROOT / "model") + os.sep


def op_time(flops: float, nbytes: float, gpu: GPU, matmul: bool, kernels: int = 1) -> float:
    """Predicted seconds of one op: max(compute, memory) + KERNEL_OVERHEAD_S per kernel."""
    if kernels <= 0:
        return 0.0
    rate = gpu.gemm_flops if matmul else gpu.vector_flops
    return max(flops / rate, nbytes / gpu.bandwidth) + KERNEL_OVERHEAD_S * kernels


# ----------------------------------------------------------------------------- op records
@dataclasses.dataclass
class OpRecord:
    name: str  # "aten.mm", "k3.grouped_mm", "fsdp.grad_cast_fp32"
    category: str
    phase: str  # forward | backward | step_end (router-bias update) | optimizer
    flops: float  # flop_registry / custom formula (0 for vector ops)
    vector_flops: float  # 1 per element for non-matmul ops
    nbytes: float
    kernels: int
    replay: Replay | None = None  # how to run it again (Trace(replay=True) only)
    region: int | None = None  # the compiled graph it ran in (--compiled), else None
    expanded: bool = False  # recorded inside a `k3::` op's PyTorch body (Trace.expand)
    count: int = 1  # runs per step: the micro-batches for forward and backward ops
    fp32_gemm: bool = False  # a GEMM of fp32 operands: the CUDA-core (vector) rate

    @property
    def matmul(self) -> bool:
        return self.name in MATMUL_OPS

    def time(self, gpu: GPU) -> float:
        """Predicted seconds per step: `count` runs of the op."""
        flops = self.flops if self.matmul else self.flops + self.vector_flops
        return self.count * op_time(flops, self.nbytes, gpu, self.matmul and not self.fp32_gemm,
                                    self.kernels)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as a replay rebuilds it: random values, these sizes and strides."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    host: bool  # a real CPU tensor in the trace (host cu_seqlens), not a device tensor


@dataclasses.dataclass(frozen=True)
class DeviceArg:
    """A `device=` argument: the replay's device."""


@dataclasses.dataclass(frozen=True)
class Replay:
    """What `benchmarks/gpu/i_ops.py` needs to run a recorded op again, without keeping its
    fake tensors alive: the overload and its arguments as specs (tensors as `TensorSpec`,
    lists as tuples, plain values as they were), or `why_not` when an argument has no spec."""
    op: object  # torch._ops.OpOverload
    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()
    why_not: str | None = None


_PLAIN = (bool, int, float, str, torch.dtype, torch.layout, torch.memory_format)


def _spec(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return TensorSpec(tuple(int(n) for n in v.shape), tuple(int(n) for n in v.stride()),
                          v.dtype, not _is_device_tensor(v))
    if v is None or isinstance(v, _PLAIN):
        return v
    if isinstance(v, torch.device):
        return DeviceArg()
    if isinstance(v, (list, tuple)):
        return tuple(_spec(x) for x in v)
    raise TypeError(f"argument of type {type(v).__name__}")


def replay_spec(func, args, kwargs) -> Replay:
    """The `Replay` of one dispatched op (`why_not` set if an argument cannot be described)."""
    try:
        return Replay(func, _spec(args), tuple((k, _spec(v)) for k, v in kwargs.items()))
    except TypeError as e:
        return Replay(func, why_not=str(e))


def _is_device_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (isinstance(t, FakeTensor) or t.is_meta)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in `t`: expanded (stride-0) dims counted once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _unique(ts) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in ts:
        if _is_device_tensor(t) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _mutated_args(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        val = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in tree_leaves(val) if isinstance(t, torch.Tensor)]
    return out


def _foreach_kernels(args) -> int:
    """Launches of CUDA's multi_tensor_apply for a foreach op over `args`' tensor lists."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a
             and isinstance(a[0], torch.Tensor)]
    if not lists:
        return 1
    max_tensors = FOREACH_MAX_TENSORS[min(len(lists), len(FOREACH_MAX_TENSORS)) - 1]
    launches, tensors, blocks = 0, 0, 0
    for t in lists[0]:
        chunks = max(1, math.ceil(t.numel() / FOREACH_CHUNK))
        tensors += 1
        while chunks > 0:
            take = min(chunks, FOREACH_MAX_BLOCKS - blocks)
            blocks += take
            chunks -= take
            if blocks == FOREACH_MAX_BLOCKS or tensors == max_tensors:
                launches += 1
                blocks = 0
                tensors = 1 if chunks > 0 else 0
    return launches + (1 if blocks or tensors else 0)


def _fp32_gemm(name: str, args) -> bool:
    """A GEMM (mm, addmm, bmm, baddbmm) whose two matrix operands, its last two tensor
    arguments, are fp32."""
    if name not in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"):
        return False
    mats = [a for a in args if isinstance(a, torch.Tensor)][-2:]
    return len(mats) == 2 and all(m.dtype == torch.float32 for m in mats)


def _op_bytes(name: str, func, args, kwargs, out) -> int:
    ins = _unique(tree_leaves((args, kwargs)))
    outs = _unique(tree_leaves(out))
    if name in GATHER_OPS:  # reads the rows it gathers, not the table
        idx = [t for t in ins[1:] if not t.is_floating_point()]
        return sum(_nbytes(t) for t in idx) + 2 * sum(_nbytes(t) for t in outs)
    if name in SCATTER_INPLACE_OPS:  # writes (accumulating: read-modify-writes) touched rows
        self_, rest = ins[0], ins[1:]
        touched = max((t.numel() for t in rest), default=0)
        if name in ("aten.index_put_", "aten._index_put_impl_"):
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        else:
            accumulate = name != "aten.scatter_"
        per = (2 if accumulate else 1) * self_.element_size()
        return sum(_nbytes(t) for t in rest) + touched * per
    mutated = _unique(_mutated_args(func, args, kwargs))
    out_ids = {id(t) for t in outs}
    written = outs + [t for t in mutated if id(t) not in out_ids]
    if name in WRITE_ONLY_OPS:
        mids = {id(t) for t in mutated}
        ins = [t for t in ins if id(t) not in mids]
    return sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in written)


def _vector_flops(args, kwargs, out) -> float:
    per_arg = [sum(t.numel() for t in tree_leaves(a) if _is_device_tensor(t))
               for a in (*args, *kwargs.values())]
    outs = sum(t.numel() for t in tree_leaves(out) if _is_device_tensor(t))
    return float(max([outs, *per_arg]))


# ----------------------------------------------------------------------------- custom formulas
def _pairs(lengths: Sequence[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def _kda_forward_flops(q: torch.Tensor, v: torch.Tensor, chunk: int,
                       lengths: Sequence[int]) -> float:
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    return float(H * sum(n * (6 * K * V + 3 * min(chunk, n) * (K + V)) for n in lengths))


class _Formulas:
    """FLOPs of our custom ops; document lengths come from the host (set per trace)."""

    def __init__(self, doc_lengths: Sequence[int] | None) -> None:
        self.doc_lengths = list(doc_lengths) if doc_lengths is not None else None

    def lengths(self, cu: torch.Tensor | None, tokens: int, rows: int, seq: int) -> list[int]:
        if cu is None:
            return [seq] * rows
        if self.doc_lengths is None or len(self.doc_lengths) != cu.numel() - 1 \
                or sum(self.doc_lengths) != tokens:
            raise ValueError(f"cu_seqlens with {cu.numel() - 1} documents over {tokens} tokens "
                             f"does not match the host document lengths {self.doc_lengths}")
        return self.doc_lengths

    def __call__(self, name: str, args) -> float | None:
        if name == "k3.grouped_mm":  # x [S, in], w [G, out, in]
            x, w = args[0], args[1]
            return 2.0 * x.shape[0] * x.shape[1] * w.shape[1]
        if name == "k3.grouped_mm_wgrad":  # dy [S, out], x [S, in]
            dy, x = args[0], args[1]
            return 2.0 * dy.shape[0] * dy.shape[1] * x.shape[1]
        if name in ("k3.wgrad_accumulate", "k3.grouped_wgrad_accumulate"):  # main, dy, x
            dy, x = args[1], args[2]
            return 2.0 * dy.shape[0] * dy.shape[1] * x.shape[1]
        if name in ("k3.varlen_attention", "k3.varlen_attention_backward"):
            bwd = name.endswith("backward")
            q, v, cu = (args[1], args[3], args[6]) if bwd else (args[0], args[2], args[3])
            N, H, D = q.shape
            pairs = _pairs(self.lengths(cu, N, 1, N))
            d_pad = max(D, v.shape[-1])
            per_pair = 3 * D + 2 * d_pad if bwd else D + d_pad
            return 2.0 * H * pairs * per_pair
        if name in KDA_OPS:
            bwd = name.endswith("bwd")
            q, v, cu, chunk = (args[2], args[4], args[8], args[12]) if bwd else (
                args[0], args[2], args[6], args[10])
            B, T = q.shape[:2]
            fwd = _kda_forward_flops(q, v, chunk, self.lengths(cu, B * T, B, T))
            return 3.0 * fwd if bwd else fwd
        return None


# ----------------------------------------------------------------------------- attribution
_FILE_CATEGORY = {
    "attnres.py": "attnres", "ops/attnres.py": "attnres",
    "dispatch.py": "moe_routing", "balancing.py": "moe_routing",
    "ops/grouped_gemm.py": "moe_routing", "ops/combine.py": "moe_routing", "loss.py": "loss",
    "ops/ce_grad.py": "loss", "ops/attention.py": "attention", "ops/kda.py": "kda",
}
_frame_cache: dict[tuple[str, str, bool], str] = {}


def _frame_category(rel: str, qualname: str, short: str) -> str:
    key = (rel, qualname, short in ("cat", "stack"))
    cat = _frame_cache.get(key)
    if cat is None:
        rel_posix = rel.replace(os.sep, "/")
        if rel_posix == "moe.py":  # the router and its statistics; LatentMoE's glue is not
            cat = "elementwise_norm" if qualname.startswith("LatentMoE.") else "moe_routing"
        elif rel_posix == "decoder.py" and key[2]:
            cat = "attnres"  # freezing the finished block into the snapshot stack
        else:
            cat = _FILE_CATEGORY.get(rel_posix, "elementwise_norm")
        _frame_cache[key] = cat
    return cat


def model_frame_category(short: str) -> str | None:
    """Category from the innermost Python frame in model/ (None outside the model)."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(MODEL_DIR):
            code = f.f_code
            return _frame_category(fn[len(MODEL_DIR):], getattr(code, "co_qualname",
                                                                  code.co_name), short)
        f = f.f_back
    return None


_TAG = "roofline_category"


def _tag_new_nodes(node, cat: str) -> None:
    """Tag `node` and the untagged nodes behind it (created by the same torch call)."""
    stack = [node]
    while stack:
        n = stack.pop()
        meta = n.metadata
        if _TAG in meta:
            continue
        meta[_TAG] = cat
        stack += [nxt for nxt, _ in n.next_functions if nxt is not None]


class _NodeTagger(TorchFunctionMode):
    """Forward only: records on each new autograd node the category of its call site."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            cat = None
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    if cat is None:
                        cat = model_frame_category(getattr(func, "__name__", "")) \
                            or "elementwise_norm"
                    _tag_new_nodes(t.grad_fn, cat)
        return out


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while torch.compile compiles (`--compiled`), on while its graphs run."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        impl = _pytorch_custom_op(func, self.trace.unfused)
        if impl is None or not self.trace.expand(self, impl, args, kwargs, _func_info(func)[0]):
            self.trace.record(func, args, kwargs, out)
        return out


def _pytorch_custom_op(func, unfused: frozenset[str] = frozenset()) -> Callable | None:
    """The Python body of a `k3::` custom op that is neither a formula op nor a fused kernel,
    or a fused kernel named in `unfused` (its body then runs its PyTorch form: `--unfused`), or
    None. torch.library keeps it in the private `torch._library.custom_ops.OPDEFS` (torch >=
    2.4); without it the op counts as one kernel."""
    name = _func_info(func)[0]
    if (not name.startswith("k3.") or name in FORMULA_OPS
            or (name in FUSED_OPS and name not in unfused)):
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return None
    return getattr(OPDEFS.get(func._schema.name), "_init_fn", None)


_FUNC_INFO: dict = {}


def _func_info(func) -> tuple[str, bool, str, Callable | None]:
    """(name, no kernel?, short name, flop_registry formula) of an OpOverload, cached."""
    info = _FUNC_INFO.get(func)
    if info is None:
        packet = func._overloadpacket
        name = str(packet)
        skip = name in NO_KERNEL_OPS or bool(getattr(func, "is_view", False))
        info = (name, skip, func.__name__.split(".")[0], flop_registry.get(packet))
        _FUNC_INFO[func] = info
    return info


class Trace:
    """Collects `OpRecord`s; `phase` is set by the driver. `replay=True`: each record also
    carries its `Replay` (benchmarks/gpu/i_ops.py)."""

    def __init__(self, doc_lengths: Sequence[int] | None = None, replay: bool = False,
                 unfused: frozenset[str] = frozenset()) -> None:
        self.records: list[OpRecord] = []
        self.unfused = unfused  # fused ops recorded as their PyTorch form's ops (--unfused)
        self.phase = "forward"
        self.formulas = _Formulas(doc_lengths)
        self.replay = replay
        # --compiled (roofline_compiled): the graph running now, its FX node's category, and
        # the (region, op) of each `k3::` op expanded inside a graph
        self.region: int | None = None
        self.category_hint: str | None = None
        self.expanded_ops: list[tuple[int, str]] = []
        self._expanding = False

    def category(self, name: str, short: str) -> str:
        if name in GEMM_OPS:
            return "gemm"
        if name in ATTENTION_OPS:
            return "attention"
        if name in KDA_OPS:
            return "kda"
        if self.phase == "optimizer":
            return "optimizer"
        if self.region is not None:  # a compiled graph: frames are generated code
            return self.category_hint or "elementwise_norm"
        cat = model_frame_category(short)
        if cat is None and self.phase == "backward":
            node = torch._C._current_autograd_node()
            cat = None if node is None else node.metadata.get(_TAG)
        return cat or "elementwise_norm"

    def record(self, func, args, kwargs, out) -> None:
        name, skip, short, formula = _func_info(func)
        if skip:
            return
        leaves = tree_leaves((args, kwargs, out))
        if not any(_is_device_tensor(t) for t in leaves):
            return  # host-only op (AdamW's CPU step counters, host cu_seqlens)
        flops = self.formulas(name, args) if name.startswith("k3.") else None
        if flops is None and formula is not None:  # (an out_dtype is not a shape argument)
            fargs = tuple(a for a in args if not isinstance(a, torch.dtype))
            flops = float(formula(*fargs, **kwargs, out_val=out))
        matmul = name in MATMUL_OPS
        vflops = 0.0 if matmul or flops else _vector_flops(args, kwargs, out)
        multi = "_foreach_" in name or name.startswith("aten._fused_adam")
        kernels = KERNELS.get(name, _foreach_kernels(args) if multi else 1)
        if name in KDA_OPS and args[-1] is True:
            kernels += KDA_PROLOGUE_KERNELS[name]
        self.records.append(OpRecord(name, self.category(name, short), self.phase,
                                     float(flops or 0.0), vflops,
                                     float(_op_bytes(name, func, args, kwargs, out)), kernels,
                                     replay_spec(func, args, kwargs) if self.replay else None,
                                     self.region, self._expanding,
                                     fp32_gemm=_fp32_gemm(name, args)))

    def expand(self, recorder: _Recorder, impl: Callable, args, kwargs, name: str = "") -> bool:
        """Record the ops of `impl(*args)` (a custom op's PyTorch body) instead of the opaque
        op; False (nothing recorded) if it does not run on these fake tensors."""
        outer, self.records = self.records, []
        expanding, self._expanding = self._expanding, True
        try:
            with recorder:
                impl(*args, **kwargs)
        except Exception:
            self.records = outer
            return False
        finally:
            self._expanding = expanding
        if self.region is not None and not expanding:
            self.expanded_ops.append((self.region, name))
        outer += self.records
        self.records = outer
        return True

    @contextlib.contextmanager
    def recording(self, phase: str, tag_nodes: bool = False) -> Iterator[None]:
        self.phase = phase
        with contextlib.ExitStack() as stack:
            if tag_nodes:
                stack.enter_context(_NodeTagger())
            stack.enter_context(_Recorder(self))
            yield


def trace_ops(fn: Callable[[], object], doc_lengths: Sequence[int] | None = None,
              backward: Callable[[object], None] | None = None,
              replay: bool = False) -> list[OpRecord]:
    """Record the ops of `fn()` (forward) and of `backward(fn's result)` under a fake mode with
    CUDA backends forced. `fn` builds its tensors itself (inside the fake mode)."""
    from model.ops.backends import force_cuda_backends

    trace = Trace(doc_lengths, replay)
    with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True):
        with trace.recording("forward", tag_nodes=True):
            res = fn()
        if backward is not None:
            with trace.recording("backward"):
                backward(res)
    return trace.records


# ----------------------------------------------------------------------------- config
def doc_bounds(batch: int, seq: int, docs_per_row: int) -> list[int]:
    """cu_seqlens of `docs_per_row` uneven documents per row (document i ~ (i+1)/sum)."""
    n = max(1, min(docs_per_row, seq))
    weights = [i + 1 for i in range(n)]
    cuts, acc = [0], 0
    for w in weights[:-1]:
        acc += w
        cuts.append(max(cuts[-1] + 1, round(seq * acc / sum(weights))))
    cuts = [c for c in cuts if c < seq]
    return [r * seq + c for r in range(batch) for c in cuts] + [batch * seq]


@dataclasses.dataclass
class Job:
    model: object  # ModelConfig
    job: object  # train.config.JobConfig
    dims: object  # parallel.dims.ParallelDims
    preset: str
    docs_per_row: int
    param_dtype: torch.dtype
    micro_batches: int  # per optimizer step on each rank: the trainer's gradient accumulation


def load_config(overrides: Sequence[str], world: int = 8) -> Job:
    """The job as `launch/pretrain.py` composes and validates it (`compose_job`, `validate_job`),
    without its device check."""
    from launch.pretrain import compose_job
    from model.config import ConfigError
    from parallel.dims import ParallelDims
    from parallel.fsdp import DTYPES
    from train.config import micro_batches, validate_job

    docs_per_row, rest = 4, []
    for o in overrides:
        if o.startswith("data.docs_per_row="):
            docs_per_row = int(o.split("=", 1)[1])
        else:
            rest.append(o)
    if not any(o.lstrip("+").startswith("cluster=") for o in rest):
        rest.append("+cluster=gpu_node8")
    job, preset = compose_job(rest)
    validate_job(job, world, check_device=False)  # the launcher's checks, but the device's
    if job.precision.gemm != "default":
        raise ConfigError(f"precision.gemm={job.precision.gemm}: the roofline models bf16 "
                          "GEMMs only")
    dims = ParallelDims.from_config(job.parallel, world)
    if docs_per_row < 1:
        raise ConfigError(f"data.docs_per_row={docs_per_row} must be >= 1")
    return Job(job.model, job, dims, preset, docs_per_row, DTYPES[job.cluster.param_dtype],
               micro_batches(job.data, dims.dp))


# ----------------------------------------------------------------------------- the step
def _cast_params(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """FSDP2's MixedPrecisionPolicy: every floating parameter computes in `dtype`; buffers keep
    theirs."""
    for p in module.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


class _Shard:
    """`named_parameters()` of each parameter's FSDP2 dim-0 shard on one of `n` ranks (the
    largest: dim 0 padded to a multiple of n; n = 1: the whole parameter), as fp32 master
    parameters on the current device (fake CPU tensors inside a FakeTensorMode)."""

    def __init__(self, module: torch.nn.Module, n: int) -> None:
        self.params = []
        for name, p in module.named_parameters():
            shape = (-(-p.shape[0] // n), *p.shape[1:]) if p.dim() else ()
            self.params.append((name, torch.nn.Parameter(
                torch.empty(shape, dtype=torch.float32), requires_grad=p.requires_grad)))

    def named_parameters(self):
        return iter(self.params)

    def parameters(self):
        return (p for _, p in self.params)


def _optimizer_ops(trace: Trace, module: torch.nn.Module, job, shards: int = 1) -> None:
    """Clip + AdamW (torch's fused AdamW, the CUDA choice of `build_optimizer`) over fake fp32
    master copies of `module`'s parameters, or of one rank's FSDP2 shard of them."""
    from model.ops.backends import force_cuda_backends
    from parallel.grads import clip_grad_norm
    from train.optim.build import build_optimizer

    with force_cuda_backends(), FakeTensorMode():  # fake CPU masters: fused AdamW takes them
        holder = _Shard(module, shards)
        params = [p for p in holder.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.empty_like(p)
        opt = build_optimizer(holder, job.optim)  # type: ignore[arg-type]  # CUDA: fused
        opt.step()  # state initialisation: not part of a steady step
        with trace.recording("optimizer"):
            if job.optim.grad_clip > 0:
                try:
                    clip_grad_norm(params, job.optim.grad_clip, optimizer=opt)
                except DataDependentOutputException:  # its final float(norm) read:
                    pass  # nothing after it to record
            opt.step()


def _fsdp_units(module: torch.nn.Module, layer: int | None, reshard: bool = True
                ) -> list[tuple[int, int, int]]:
    """(parameters, all-gathers per micro-batch, parameter tensors) of each FSDP unit: every
    decoder layer, then the root (parallel.fsdp.apply_fsdp: the last layer and the root stay
    gathered until backward; with `reshard` false every unit does). One traced layer counts as
    a middle layer."""
    mid = 2 if reshard else 1

    def size(m: torch.nn.Module) -> tuple[int, int]:
        ps = list(m.parameters())
        return sum(p.numel() for p in ps), len(ps)

    if layer is not None:
        n, t = size(module)
        return [(n, mid, t)]
    layers = list(module.layers.values())
    units = []
    for i, m in enumerate(layers):
        n, t = size(m)
        units.append((n, mid if i < len(layers) - 1 else 1, t))
    n_all, t_all = size(module)
    return units + [(n_all - sum(u[0] for u in units), 1, t_all - sum(u[2] for u in units))]


def _fsdp_copies(trace: Trace, units: list[tuple[int, int, int]], shards: int = 1,
                 micro_batches: int = 1, keep_gathered: bool = False,
                 fused: tuple[int, int] = (0, 0)) -> None:
    """FSDP2's mixed-precision copies (analytic), per unit and all-gather: copy-in of the fp32
    shard into the bf16 all-gather buffer (6 B per shard element), copy-out of the gathered
    bf16 parameters (4 B per element), one kernel each, every micro-batch (each one's forward
    and backward gather again), or once per step with `keep_gathered`
    (`parallel.fsdp.units_stay_gathered`). Gradient accumulation over N > 1 micro-batches
    (FSDP2 without gradient sync,
    `FSDPParam.to_accumulated_grad_if_needed` / `accumulate_unsharded_grad_if_needed`): after the
    first backward each unsharded bf16 gradient becomes an fp32 copy (6 B per element), after each
    later one it is added into it (10 B), one kernel per parameter tensor each. Before the
    reduce-scatter, the gradients into the fp32 buffer: 6 B per element from bf16, 8 B from the
    fp32 accumulator; one kernel per unit. `fused` (elements, tensors) of the weights whose
    wgrad GEMMs add into the accumulator themselves (`parallel.grad_accumulation`): no cast or
    add for them (their buffers' zeroing, once a step, is traced)."""
    gathered = sum(n * g for n, g, _ in units)
    gathers = sum(g for _, g, _ in units)
    params = sum(n for n, _, _ in units)
    tensors = sum(t for _, _, t in units)
    n = micro_batches

    def add(name: str, elems: float, per_elem: int, kernels: int, count: int = 1) -> None:
        trace.records.append(OpRecord(name, "optimizer", "optimizer", 0.0, float(elems),
                                      float(per_elem * elems), kernels, count=count))

    every = 1 if keep_gathered else n
    add("fsdp.all_gather_copy_in", -(-gathered // shards), 6, gathers, every)
    add("fsdp.all_gather_copy_out", gathered, 4, gathers, every)
    if n > 1:
        fused_elems, fused_tensors = fused
        add("fsdp.grad_to_fp32", params - fused_elems, 6, tensors - fused_tensors)
        add("fsdp.grad_accumulate", params - fused_elems, 10, tensors - fused_tensors, n - 1)
    add("fsdp.reduce_scatter_copy_in", params, 6 if n == 1 else 8, len(units))


def _layer_active_params(module: torch.nn.Module, cfg) -> int:
    from model.moe import RoutedExperts

    active = 0
    for mod in module.modules():
        n = sum(p.numel() for p in mod.parameters(recurse=False))
        if isinstance(mod, RoutedExperts):
            n = n * cfg.num_experts_per_token // cfg.num_experts
        elif isinstance(mod, torch.nn.Embedding):
            n = 0
        active += n
    return active


def _layer_model_flops(cfg, layer: torch.nn.Module, idx: int, lengths: list[int]) -> float:
    """The trainer's count restricted to one layer: 6 * its active parameters per token plus its
    own attention / KDA term (train.observe.flops)."""
    from train.observe.flops import kda_flops_per_token, mla_flops_per_token

    tokens = sum(lengths)
    mixer = (sum(n * n for n in lengths) * mla_flops_per_token(cfg, 1)
             if cfg.layer_type(idx) == "mla"
             else sum(n * kda_flops_per_token(cfg, n) for n in lengths))
    return 6.0 * _layer_active_params(layer, cfg) * tokens + mixer


def trace_step(job: Job, layer: int | None = None, optimizer_shards: int = 1,
               replay: bool = False, compiled: bool = False,
               unfused: frozenset[str] = frozenset()) -> tuple[list[OpRecord], dict]:
    """Records of one step (whole model, or decoder layer `layer`) and the model FLOPs;
    the optimizer and FSDP copy-in over one rank's share of `optimizer_shards`; `replay`:
    records carry their `Replay`; `compiled`: decoder layers as inductor fuses them
    (benchmarks/roofline_compiled.py); `unfused`: these fused ops as their PyTorch form."""
    from model.decoder import DecoderLayer, K3Model
    from model.ops.backends import force_cuda_backends
    from model.packing import Packing
    from parallel.fsdp import units_stay_gathered
    from parallel.grad_accumulation import attach_local_main_grads
    from parallel.parallelize import fuses_grad_accumulation
    from train.observe.flops import step_flops

    cfg, d = job.model, job.job.data
    B, T = d.micro_batch, d.seq_len
    bounds = doc_bounds(B, T, job.docs_per_row)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    cu_host = torch.tensor(bounds, dtype=torch.int32)
    trace = Trace(lengths, replay, unfused)
    dtype = job.param_dtype
    if layer is None:
        module = K3Model(cfg, device="meta")
    else:
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"--layer {layer} outside 0..{cfg.num_hidden_layers - 1}")
        module = DecoderLayer(cfg, layer, device="meta")
    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    master = module  # meta fp32 parameters: the optimizer's view
    compute = K3Model(cfg, device="meta") if layer is None else DecoderLayer(cfg, layer, "meta")
    _cast_params(compute, dtype)
    regions = CompiledRegions(trace, sys.modules[__name__])
    layers = (compute.decoder_layers() if layer is None else [compute]) if compiled else []
    n_micro = job.micro_batches
    fused_accumulation = fuses_grad_accumulation(job.job, job.dims, n_micro)
    fused_elems = fused_tensors = 0
    with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True), \
            contextlib.ExitStack() as stack:
        compute.to_empty(device="cpu")
        compute.train()
        if fused_accumulation:  # the wgrad GEMMs add into fp32 buffers (parallel.fuse_grad_...)
            mains = attach_local_main_grads(compute, torch.float32)
            fused_elems = sum(b.numel() for b in mains.values())
            fused_tensors = len(mains)
            with trace.recording("optimizer"):  # MainGrads.begin_step, once a step
                torch._foreach_zero_(list(mains.values()))
        if compiled:
            stack.enter_context(regions.compiled(layers))
        cu = torch.tensor(bounds, dtype=torch.int32)
        packing = Packing(B, T, "cpu", cu, max_seqlen=max(lengths), cu_seqlens_cpu=cu_host)
        if layer is None:
            ids = torch.zeros(B, T, dtype=torch.long)
            labels = torch.zeros(B, T, dtype=torch.long)
            scale = 1.0 / (B * T)
            with trace.recording("forward", tag_nodes=True):
                loss_sum, _ = compute(ids, packing, labels=labels)
                loss = loss_sum * scale
            with trace.recording("backward"):
                loss.backward()
            with trace.recording("step_end"):  # between steps: router biases (QB)
                compute.apply_quantile_balancing()
        else:
            n_blocks = -(-layer // cfg.attn_res_block_size)
            prefix = torch.randn(B, T, cfg.hidden_size, dtype=dtype, requires_grad=True)
            blocks = torch.randn(n_blocks, B, T, cfg.hidden_size, dtype=dtype,
                                 requires_grad=True)
            with trace.recording("forward", tag_nodes=True):
                out, new_blocks = compute(prefix, blocks, packing)
            grads = (torch.empty_like(out), torch.empty_like(new_blocks))
            with trace.recording("backward"):
                torch.autograd.backward((out, new_blocks), grads)
            if hasattr(compute, "block_sparse_moe"):
                with trace.recording("step_end"):
                    compute.block_sparse_moe.gate.apply_quantile_balancing()
    unmatched: dict = {}
    if compiled:
        trace.records, unmatched = regions.substitute(trace.records)
    for r in trace.records:  # every micro-batch runs forward and backward; the rest is per step
        if r.phase in ("forward", "backward"):
            r.count = n_micro
    _optimizer_ops(trace, master, job.job, optimizer_shards)
    keep = units_stay_gathered(job.job.parallel.reshard_after_forward, job.dims.pp)
    _fsdp_copies(trace, _fsdp_units(master, layer, reshard=not keep), optimizer_shards, n_micro,
                 keep, (fused_elems, fused_tensors))
    if layer is None:
        model_flops = step_flops(cfg, lengths)
    else:
        model_flops = _layer_model_flops(cfg, master, layer, lengths)
    return trace.records, {"model_flops": n_micro * model_flops, "tokens": n_micro * B * T,
                           "doc_lengths": lengths,
                           "params": n_params, "module": master,
                           "compiled_graphs": len(regions.regions),
                           "unmatched_externs": unmatched}


# ----------------------------------------------------------------------------- communication
def comm_bytes(job: Job, module: torch.nn.Module, layer: int | None) -> tuple[dict, dict]:
    """Per-rank bytes sent per step, by parallel dimension (see the module docstring)."""
    from parallel.fsdp import DTYPES, units_stay_gathered
    from parallel.tensor_parallel import tp_shard_plan

    cfg, dims, d, par = job.model, job.dims, job.job.data, job.job.parallel
    p_bytes = DTYPES[job.job.cluster.param_dtype].itemsize
    g_bytes = DTYPES[job.job.cluster.reduce_dtype].itemsize
    tp, pp, ep, dps, rep, edp = dims.tp, dims.pp, dims.ep, dims.dp_shard, dims.dp_replicate, \
        dims.edp
    stage = 1 if layer is not None else pp  # a traced layer lives on one stage
    plan = tp_shard_plan(module)
    sharded = replicated = experts = 0
    for name, p in module.named_parameters():
        if ".experts.w" in f".{name}":
            experts += p.numel()
        elif name in plan:
            sharded += p.numel()
        else:
            replicated += p.numel()
    if ep == 1:  # experts replicated over tp, FSDP'd with everything else
        replicated, experts = replicated + experts, 0
    dense_local = (sharded / tp + replicated) / stage
    expert_local = experts / ep / stage
    n_micro = job.micro_batches  # activations move every micro-batch, and FSDP gathers
    gathers = 1 if units_stay_gathered(par.reshard_after_forward, pp) else 2 * n_micro
    frac = lambda n: (n - 1) / n  # noqa: E731
    detail = {
        "fsdp_all_gather": frac(dps) * dense_local * p_bytes * gathers,
        "fsdp_reduce_scatter": frac(dps) * dense_local * g_bytes,
        "edp_all_gather": frac(edp) * expert_local * p_bytes * gathers if ep > 1 else 0.0,
        "edp_reduce_scatter": frac(edp) * expert_local * g_bytes if ep > 1 else 0.0,
        "hsdp_all_reduce": 2 * frac(rep) * (dense_local / dps
                                            + (expert_local / edp if ep > 1 else 0)) * g_bytes,
    }
    B, T, hid = d.micro_batch, d.seq_len, cfg.hidden_size
    act = B * T * hid * p_bytes  # one [B, T, d] activation in the compute dtype
    tokens = n_micro * B * T / tp
    idxs = [layer] if layer is not None else list(range(cfg.num_hidden_layers))
    regions = sum(1 + (1 if (not cfg.is_moe_layer(i) or cfg.num_shared_experts > 0) else 0)
                  for i in idxs) / stage
    ends = 0 if layer is not None else (2 if pp == 1 else 1)  # embedding, head
    detail["tp_activations"] = frac(tp) * act * n_micro * (4 * regions + 2 * ends)
    detail["tp_replicated_grad_all_reduce"] = 2 * frac(tp) * replicated / stage / dps * g_bytes
    pp_bytes = 0.0
    if layer is None and pp > 1:
        ns, L = dims.num_stages, cfg.num_hidden_layers
        ends_at = [round((s + 1) * L / ns) - 1 for s in range(ns)]  # last layer of each stage
        send = [0.0] * pp
        for s in range(ns):
            rank = s % pp
            if s < ns - 1:  # forward: AttnRes state after this stage's last layer
                state = (1 + ends_at[s] // cfg.attn_res_block_size + 1) * act / tp
                send[rank] += state
            if s > 0:  # backward: the gradient of this stage's input state
                state = (1 + ends_at[s - 1] // cfg.attn_res_block_size + 1) * act / tp
                send[rank] += state
        pp_bytes = n_micro * max(send)
    detail["pp_activations"] = pp_bytes
    moe_layers = sum(1 for i in idxs if cfg.is_moe_layer(i)) / stage
    detail["ep_tokens"] = (2 * 2 * tokens * cfg.num_experts_per_token
                           * cfg.routed_expert_hidden_size * p_bytes * frac(ep) * moe_layers)
    epn = cfg.num_experts // ep
    per_expert = 3 * cfg.routed_expert_hidden_size * cfg.moe_intermediate_size * p_bytes
    detail["ep_replica_weights_max"] = (2 * n_micro * epn * per_expert * moe_layers
                                        if ep > 1 and par.ep_replicas else 0.0)
    by_dim = {
        "dp_shard": detail["fsdp_all_gather"] + detail["fsdp_reduce_scatter"],
        "edp": detail["edp_all_gather"] + detail["edp_reduce_scatter"],
        "dp_replicate": detail["hsdp_all_reduce"],
        "tp": detail["tp_activations"] + detail["tp_replicated_grad_all_reduce"],
        "pp": detail["pp_activations"],
        "ep": detail["ep_tokens"] + detail["ep_replica_weights_max"],
    }
    return ({k: float(round(v)) for k, v in by_dim.items()},
            {k: float(round(v)) for k, v in detail.items()})


# ----------------------------------------------------------------------------- summary
def top_ops(records: Sequence[OpRecord], gpu: GPU, n: int = 20) -> list[dict]:
    """Ops grouped by (name, category), the `n` largest by predicted time."""
    agg: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"count": 0, "flops": 0.0, "bytes": 0.0, "s": 0.0})
    for r in records:
        a = agg[(r.name, r.category)]
        a["count"] += r.count
        a["flops"] += r.count * r.flops
        a["bytes"] += r.count * r.nbytes
        a["s"] += r.time(gpu)
    rows = [{"op": k[0], "category": k[1], **v} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r["s"])[:n]


def summarize(records: Sequence[OpRecord], gpu: GPU, model_flops: float) -> dict:
    by_cat = {c: {"s": 0.0, "flops": 0.0, "bytes": 0.0, "kernels": 0, "vector_flops": 0.0}
              for c in CATEGORIES}
    by_phase: dict[str, float] = defaultdict(float)
    fb_kernels, fb_bytes = 0, 0.0
    for r in records:
        if r.phase in ("forward", "backward"):
            fb_kernels += r.count * r.kernels
            fb_bytes += r.count * r.nbytes
        t = r.time(gpu)
        c = by_cat[r.category]
        c["s"] += t
        c["flops"] += r.count * r.flops
        c["vector_flops"] += r.count * r.vector_flops
        c["bytes"] += r.count * r.nbytes
        c["kernels"] += r.count * r.kernels
        by_phase[r.phase] += t
    total = sum(c["s"] for c in by_cat.values())
    compute = sum(by_cat[c]["s"] for c in COMPUTE_CATEGORIES)
    fwd_bwd = by_phase["forward"] + by_phase["backward"]
    return {
        "model_flops": model_flops,
        "traced_flops": sum(c["flops"] for c in by_cat.values()),
        "vector_flops": sum(c["vector_flops"] for c in by_cat.values()),
        "predicted_step_s": total,
        "predicted_mfu": model_flops / (total * gpu.peak_bf16) if total > 0 else 0.0,
        "kernels": sum(c["kernels"] for c in by_cat.values()),
        "fwd_bwd_s": fwd_bwd,
        "fwd_bwd_mfu": model_flops / (fwd_bwd * gpu.peak_bf16) if fwd_bwd > 0 else 0.0,
        "fwd_bwd_kernels": fb_kernels, "fwd_bwd_bytes": fb_bytes,
        "by_category": by_cat,
        "by_phase": dict(by_phase),
        "non_gemm_fraction": (total - compute) / total if total > 0 else 0.0,
    }


def unfused_ops(spec: str | Sequence[str] = ()) -> frozenset[str]:
    """`--unfused`: "all", or fused-op families by name ("situ_glu,row_norm"; each takes its
    backward along), or full names ("k3.situ_glu")."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: set[str] = set()
    for n in (n.strip() for n in names if n.strip()):
        if n == "all":
            out |= FUSED_OPS
            continue
        family = {f for f in FUSED_OPS if f in (n, f"k3.{n}", f"k3.{n}_bwd", f"{n}_bwd")}
        if not family:
            short = sorted({f.removeprefix("k3.").removesuffix("_bwd") for f in FUSED_OPS})
            raise ValueError(f"--unfused {n!r}: not a fused op; choose from all, {short}")
        out |= family
    return frozenset(out)


def analyze(overrides: Sequence[str] = (), gpu: str = "h200", layer: int | None = None,
            world: int = 8, optimizer_shards: int = 1, replay: bool = False,
            compiled: bool = False, unfused: str | Sequence[str] = ()
            ) -> tuple[dict, list[OpRecord]]:
    """(the JSON summary, the op records) of one predicted step; `replay`: the records carry
    their `Replay` (the JSON is the same); `unfused`: fused ops costed as their PyTorch form
    (`unfused_ops`)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r}: choose one of {sorted(GPUS)}")
    unfused_set = unfused_ops(unfused)
    g = GPUS[gpu]
    job = load_config(overrides, world)
    if optimizer_shards < 1:
        raise ValueError(f"--optimizer-shards {optimizer_shards} must be >= 1")
    records, info = trace_step(job, layer, optimizer_shards, replay, compiled, unfused_set)
    by_dim, detail = comm_bytes(job, info["module"], layer)
    out = {
        "gpu": g.name, "preset": job.preset, "layer": layer,
        "layer_kind": None if layer is None else
        f"{job.model.layer_type(layer)}+{'moe' if job.model.is_moe_layer(layer) else 'dense'}",
        "seq_len": job.job.data.seq_len, "micro_batch": job.job.data.micro_batch,
        "micro_batches": job.micro_batches, "global_batch": job.job.data.global_batch,
        "docs_per_row": job.docs_per_row, "optimizer_shards": optimizer_shards,
        "compiled": compiled, "compiled_graphs": info["compiled_graphs"],
        "unfused": sorted(unfused_set),
        "unmatched_externs": info["unmatched_externs"],
        "doc_lengths": info["doc_lengths"],
        "tokens": info["tokens"], "params": info["params"], "dtype": str(job.param_dtype),
        **summarize(records, g, info["model_flops"]),
        "comm_bytes": by_dim, "comm_detail": detail,
        "layout": {"world": job.dims.world_size, "dp_replicate": job.dims.dp_replicate,
                   "dp_shard": job.dims.dp_shard, "tp": job.dims.tp, "pp": job.dims.pp,
                   "ep": job.dims.ep, "edp": job.dims.edp},
        "constants": {"gemm_flops": g.gemm_flops, "bandwidth": g.bandwidth,
                      "vector_flops": g.vector_flops, "peak_bf16": g.peak_bf16,
                      "kernel_overhead_s": KERNEL_OVERHEAD_S},
    }
    return out, records


def roofline(overrides: Sequence[str] = (), gpu: str = "h200", layer: int | None = None,
             world: int = 8, optimizer_shards: int = 1, compiled: bool = False,
             unfused: str | Sequence[str] = ()) -> dict:
    """The JSON summary of one predicted step (see the module docstring)."""
    return analyze(overrides, gpu, layer, world, optimizer_shards, compiled=compiled,
                   unfused=unfused)[0]


def format_table(rows: Sequence[dict]) -> str:
    lines = [f"{'op':34s} {'category':16s} {'count':>6s} {'FLOPs':>10s} {'bytes':>10s} "
             f"{'pred ms':>9s}"]
    for r in rows:
        lines.append(f"{r['op']:34s} {r['category']:16s} {r['count']:6d} {r['flops']:10.3e} "
                     f"{r['bytes']:10.3e} {r['s'] * 1e3:9.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from model.config import ConfigError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--table", action="store_true", help="top 20 ops to stderr")
    ap.add_argument("--layer", type=int, default=None, help="trace decoder layer N only")
    ap.add_argument("--world", type=int, default=8, help="ranks, for comm_bytes (default 8)")
    ap.add_argument("--optimizer-shards", type=int, default=1,
                    help="optimizer + FSDP copy-in over 1/N of the parameters (default 1)")
    ap.add_argument("--compiled", action="store_true",
                    help="decoder layers as inductor fuses them (parallel.compile=true)")
    ap.add_argument("--unfused", default="",
                    help="fused ops costed as their PyTorch form: all, or names (situ_glu,...)")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        ap.error(f"unknown option(s) {bad}")
    torch.set_num_threads(1)
    try:
        out, records = analyze(overrides, args.gpu, args.layer, args.world,
                                args.optimizer_shards, compiled=args.compiled,
                                unfused=args.unfused)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.table:
        print(format_table(top_ops(records, GPUS[args.gpu])), file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

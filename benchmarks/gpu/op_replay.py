"""Arguments for replaying a recorded op (`roofline.Replay`) on a real device: stage i_ops.

Tensors are random, with the recorded sizes, strides and dtypes (built on a flat buffer as long
as the strides reach, so expanded and transposed layouts are the traced ones). Values matter only
where a kernel reads them as positions, and there a wrong value is a device-side assert that
poisons the CUDA context for every later op. So integer tensors get values only where their
meaning is known:

* index arguments of gather / scatter / index_select / index_add / embedding / index /
  index_put / nll_loss / one_hot: uniform in the valid range of the dimension they index;
* `cu_seqlens*` (varlen attention, fla KDA): the traced step's document bounds;
  `offs` of k3::grouped_mm(_wgrad): equal groups over the rows; `inverse` of
  k3::moe_combine(_bwd): a random permutation of the rows;
* ops that only compute with integers (comparisons, arithmetic, casts, sorts, cumsum, ...),
  and the other integer arguments of the index ops (what they gather or add): 1..4 (no zero
  divisors);

any other op with an integer argument is `NotReplayable`, as is a boolean index (its output
size depends on the values). Floats are N(0, 1), except probabilities (bernoulli, binary
cross-entropy) in [0, 1) and fla KDA's log-decay `g` in [-0.5, 0) and `beta` in [0, 1).
Not here: checking that a replay computes anything meaningful; the values are noise.
"""

from __future__ import annotations

import math

import torch
from roofline import DeviceArg, Replay, TensorSpec


class NotReplayable(Exception):
    """The op cannot be replayed safely here; the message says why."""


DIM_INDEX_OPS = {"aten.gather", "aten.scatter", "aten.scatter_", "aten.scatter_add",
                 "aten.scatter_add_", "aten.scatter_reduce", "aten.scatter_reduce_",
                 "aten.index_select", "aten.index_add", "aten.index_add_", "aten.index_copy",
                 "aten.index_copy_", "aten.index_fill", "aten.index_fill_"}
LIST_INDEX_OPS = {"aten.index", "aten._unsafe_index", "aten.index_put", "aten.index_put_",
                  "aten._index_put_impl_", "aten._unsafe_index_put"}
NLL_OPS = {"aten.nll_loss_forward", "aten.nll_loss_backward", "aten.nll_loss2d_forward",
           "aten.nll_loss2d_backward"}
INDEX_OPS = DIM_INDEX_OPS | LIST_INDEX_OPS | NLL_OPS | {"aten.embedding",
                                                        "aten.embedding_dense_backward",
                                                        "aten.one_hot"}
INT_SAFE_OPS = {
    "aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge", "aten._to_copy",
    "aten.copy_", "aten.clone", "aten.add", "aten.add_", "aten.sub", "aten.sub_", "aten.mul",
    "aten.mul_", "aten.div", "aten.div_", "aten.floor_divide", "aten.remainder", "aten.neg",
    "aten.abs", "aten.ones_like", "aten.zeros_like", "aten.full_like", "aten.sort",
    "aten.argsort", "aten.topk", "aten.cumsum", "aten.cumsum_", "aten.sum", "aten.prod",
    "aten.max", "aten.min", "aten.amax", "aten.amin", "aten.argmax", "aten.argmin",
    "aten.clamp", "aten.clamp_", "aten.clamp_min", "aten.clamp_max", "aten.maximum",
    "aten.minimum", "aten.flip", "aten.cat", "aten.stack", "aten.bitwise_and",
    "aten.bitwise_or", "aten.bitwise_xor", "aten.bitwise_not", "aten.logical_and",
    "aten.logical_or", "aten.logical_not", "aten.where", "aten.zero_", "aten.fill_",
    "aten.masked_fill", "aten.masked_fill_", "aten.constant_pad_nd", "aten.repeat",
    "aten.lift_fresh_copy", "aten.mean", "aten.any", "aten.all",
    "k3.short_conv", "k3.short_conv_bwd",  # pos_in_doc: only compared with the tap offsets
}
UNIT_FLOAT_OPS = {"aten.bernoulli", "aten.bernoulli_", "aten.binary_cross_entropy",
                  "aten.binary_cross_entropy_backward", "aten.multinomial", "aten.poisson"}
KDA_OPS = {"k3.chunk_kda_fla", "k3.chunk_kda_fla_bwd"}
CUDA_ONLY_OPS = KDA_OPS | {"k3.varlen_attention", "k3.varlen_attention_backward"}
CU_NAMES = {"cu_seqlens", "cu_seqlens_cpu", "cu_seq_q", "cu_seq_k"}
SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16",
                torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool",
                torch.uint8: "u8", torch.int8: "i8"}


def packet(op) -> str:
    """'aten.gather' for torch.ops.aten.gather.default."""
    return str(op._overloadpacket)


def named_args(rp: Replay) -> list[tuple[str, object]]:
    """(schema name, spec) of every argument, positional ones first."""
    names = [a.name for a in rp.op._schema.arguments]
    pos = [(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(rp.args)]
    return pos + list(rp.kwargs)


def device_why_not(op, device: torch.device) -> str | None:
    """Why `op` cannot run on `device` (None: it can)."""
    if device.type != "cuda" and packet(op) in CUDA_ONLY_OPS:
        return "CUDA-only kernel"
    key = "CUDA" if device.type == "cuda" else "CPU"
    try:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        if not any(has(op.name(), k) for k in (key, "CompositeExplicitAutograd",
                                               "CompositeImplicitAutograd",
                                               "CompositeExplicitAutogradNonFunctional")):
            return f"no {key} kernel for {op.name()}"
    except (AttributeError, RuntimeError):  # private API gone: let the call decide
        pass
    return None


def _extent(spec: TensorSpec) -> int:
    """Elements of the flat buffer the strides reach."""
    if any(n == 0 for n in spec.shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride))


def _tensors(v: object):
    if isinstance(v, TensorSpec):
        yield v
    elif isinstance(v, tuple):
        for x in v:
            yield from _tensors(x)


def input_bytes(rp: Replay) -> int:
    return sum(_extent(t) * t.dtype.itemsize for _, v in named_args(rp) for t in _tensors(v))


def _index_high(op: str, name: str, pos: int | None, named: dict) -> int | None:
    """Exclusive bound of the values of integer argument `name` (element `pos` of a list) when
    it holds positions, else None."""
    s = named.get("self")
    if op in DIM_INDEX_OPS and name == "index":
        shape = s.shape or (1,)
        return shape[named["dim"] % len(shape)]
    if op == "aten.embedding" and name == "indices":
        return named["weight"].shape[0]
    if op == "aten.embedding_dense_backward" and name == "indices":
        return named["num_weights"]
    if op in LIST_INDEX_OPS and name == "indices":
        return s.shape[pos] if pos is not None and pos < len(s.shape) else 0
    if op in NLL_OPS and name == "target":
        return s.shape[1] if len(s.shape) >= 2 else s.shape[0]
    if op == "aten.one_hot" and name == "self":
        return named["num_classes"] if named["num_classes"] > 0 else 0
    return None


class _Builder:
    def __init__(self, rp: Replay, device: torch.device, bounds: list[int]) -> None:
        self.op = packet(rp.op)
        self.named = dict(named_args(rp))
        self.device, self.bounds = device, bounds

    def value(self, name: str, v: object, pos: int | None = None) -> object:
        if isinstance(v, TensorSpec):
            return self.tensor(name, v, pos)
        if isinstance(v, DeviceArg):
            return self.device
        if isinstance(v, tuple):
            return [self.value(name, x, i) for i, x in enumerate(v)]
        return v

    def tensor(self, name: str, spec: TensorSpec, pos: int | None) -> torch.Tensor:
        dev = torch.device("cpu") if spec.host else self.device
        n, dt = _extent(spec), spec.dtype
        if dt.is_complex:
            raise NotReplayable(f"complex argument {name}")
        if dt.is_floating_point:
            flat = self.floats(name, n, dt, dev)
        else:
            flat = self.integers(name, spec, pos, n, dev)
        return flat.as_strided(spec.shape, spec.stride)

    def floats(self, name: str, n: int, dt: torch.dtype, dev: torch.device) -> torch.Tensor:
        native = dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        make = dt if native else torch.float32  # float8: drawn in fp32, then cast
        if self.op in UNIT_FLOAT_OPS or (self.op in KDA_OPS and name == "beta"):
            t = torch.rand(n, dtype=make, device=dev)
        elif self.op in KDA_OPS and name == "g":
            t = torch.rand(n, dtype=make, device=dev).mul_(-0.5)
        else:
            t = torch.randn(n, dtype=make, device=dev)
        return t if native else t.to(dt)

    def integers(self, name: str, spec: TensorSpec, pos: int | None, n: int,
                 dev: torch.device) -> torch.Tensor:
        dt = spec.dtype
        if name in CU_NAMES:
            if math.prod(spec.shape) != len(self.bounds) or spec.stride not in ((1,), (0,)):
                raise NotReplayable(f"{name} of {spec.shape}: not the traced "
                                    f"{len(self.bounds) - 1} documents")
            return torch.tensor(self.bounds, dtype=dt, device=dev)
        if self.op in ("k3.grouped_mm", "k3.grouped_mm_wgrad",
                       "k3.grouped_wgrad_accumulate") and name == "offs":
            rows_of = self.named.get("dy", self.named[next(iter(self.named))])  # [S, ...]
            rows, groups = rows_of.shape[0], math.prod(spec.shape)
            if spec.stride != (1,):
                raise NotReplayable(f"offs of strides {spec.stride}")
            ends = [round((i + 1) * rows / groups) for i in range(groups)]  # equal groups
            return torch.tensor(ends, dtype=dt, device=dev)
        if self.op in ("k3.moe_combine", "k3.moe_combine_bwd") and name == "inverse":
            return torch.randperm(n, device=dev).to(dt)  # a permutation of y's rows
        if self.op == "k3.ce_logit_grad" and name == "labels":  # vocabulary ids of the logits
            return torch.randint(0, self.named["logits"].shape[1], (n,), dtype=dt, device=dev)
        if self.op == "k3.record_router_stats":
            if name == "topk_idx":  # expert ids of the scores
                return torch.randint(0, self.named["scores"].shape[1], (n,), dtype=dt,
                                     device=dev)
            return torch.zeros(n, dtype=dt, device=dev)  # the count buffers it adds into
        if dt == torch.bool and self.op in LIST_INDEX_OPS and name == "indices":
            raise NotReplayable("boolean mask index (data-dependent output size)")
        high = _index_high(self.op, name, pos, self.named)
        if high is not None:
            if high <= 0 < n:
                raise NotReplayable(f"index {name} into an empty dimension")
            return torch.randint(0, max(high, 1), (n,), dtype=dt, device=dev)
        if dt == torch.bool:
            return torch.randint(0, 2, (n,), device=dev).bool()
        if self.op in INT_SAFE_OPS | INDEX_OPS or self.op.startswith("aten._foreach_"):
            return torch.randint(1, 5, (n,), dtype=dt, device=dev)
        raise NotReplayable(f"integer argument {name!r}: no values known to be safe")


def build(rp: Replay, device: torch.device, bounds: list[int]) -> tuple[list, dict]:
    """(args, kwargs) for `rp.op` on `device`; `bounds`: the traced document bounds."""
    b = _Builder(rp, device, bounds)
    names = [a.name for a in rp.op._schema.arguments]
    args = [b.value(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(rp.args)]
    return args, {k: b.value(k, v) for k, v in rp.kwargs}


def _short(spec: TensorSpec) -> str:
    dims = "x".join(str(n) for n in spec.shape) or "scalar"
    contiguous = all(s == math.prod(spec.shape[i + 1:]) for i, s in enumerate(spec.stride)
                     if spec.shape[i] > 1)
    return (f"{dims} {SHORT_DTYPES.get(spec.dtype, str(spec.dtype).removeprefix('torch.'))}"
            + ("" if contiguous else " strided") + (" host" if spec.host else ""))


def describe(rp: Replay, limit: int = 160) -> str:
    """The tensor arguments in short ('4096x2048 bf16, 2048x2048 bf16 strided'); lists of more
    than 3 tensors as their count and elements; dtype arguments as name=dtype."""
    parts = []
    for name, v in named_args(rp):
        if isinstance(v, TensorSpec):
            parts.append(_short(v))
        elif isinstance(v, torch.dtype):
            parts.append(f"{name}={SHORT_DTYPES.get(v, v)}")
        elif isinstance(v, tuple) and any(isinstance(x, TensorSpec) for x in v):
            ts = [x for x in v if isinstance(x, TensorSpec)]
            if len(ts) <= 3:
                parts.append("[" + ", ".join(_short(x) for x in ts) + "]")
            else:
                dts = "/".join(sorted({SHORT_DTYPES.get(x.dtype, str(x.dtype)) for x in ts}))
                parts.append(f"{len(ts)} x {dts} ({sum(math.prod(x.shape) for x in ts):.3g} el)")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."

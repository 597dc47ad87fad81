"""Fake-tensor memory trace of one training step: the measurement `parallel.activation_memory`
is checked against.

Under `FakeTensorMode` (nothing allocated) with every backend forced to its CUDA choice (fla KDA,
varlen attention, grouped GEMMs, our fused ops: one opaque custom op each, so what autograd
keeps is exactly what their `setup_context` saves, as on a GPU), a dispatch mode counts the
bytes of every storage an op creates until it dies (weak references), leaving out parameters
and, once accumulated, their gradients. It reports the bytes alive when the forward ends (what
the step keeps for backward) and the peak over forward and backward. Kernel-internal
temporaries (fla's recomputed chunk states, FlashAttention's tiles) are invisible here: the
analytic model adds them separately.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from model.config import ModelConfig
from model.decoder import K3Model
from model.mtp import stack_targets
from model.ops.backends import force_cuda_backends
from model.packing import Packing, shard_window
from parallel.activation_checkpoint import apply_activation_checkpointing


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding `t`'s bytes on this rank (a DTensor's local shard)."""
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create, alive now and at most so far."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded  # storage ids never counted (parameters)
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self._refs: list[weakref.ref] = []

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def exclude(self, t: torch.Tensor) -> None:
        """Stop counting `t`'s storage (a parameter's accumulated gradient)."""
        key = _storage(t)._cdata
        self.excluded.add(key)
        self._free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = _storage(t)
            key = st._cdata
            if key in self.sizes or key in self.excluded:
                continue
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            self._refs.append(weakref.ref(st, lambda _, k=key: self._free(k)))
        return out


@dataclass(frozen=True)
class StepTrace:
    saved_bytes: int  # alive when the forward (loss included) has returned
    peak_bytes: int  # the most alive at once over forward and backward


def _packing(batch: int, seq: int, docs_per_row: int) -> Packing:
    step = seq // docs_per_row
    starts = [0, *(i * step - 3 for i in range(1, docs_per_row))]
    cu = [r * seq + s for r in range(batch) for s in starts] + [batch * seq]
    return Packing(batch, seq, "cpu", torch.tensor(cu, dtype=torch.int32), max_seqlen=seq)


def trace_step(cfg: ModelConfig, batch: int, seq: int, ac: str = "none",
               dtype: torch.dtype = torch.bfloat16, docs_per_row: int = 4,
               prepare: Callable[[K3Model], None] | None = None) -> StepTrace:
    """One packed forward+backward of `cfg` on [batch, seq] tokens in `dtype`, under fake
    tensors with the CUDA backends and activation checkpointing `ac`. `prepare(model)` (on
    the meta device) applies a parallel layout over a fake process group first."""
    model = K3Model(cfg, device="meta").to(dtype)
    if prepare is not None:
        prepare(model)
    apply_activation_checkpointing(model.decoder_layers(), ac)
    with force_cuda_backends(), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        ids = torch.zeros(batch, seq, dtype=torch.long)
        labels = torch.zeros(batch, seq, dtype=torch.long)
        if model.context_shard is not None:  # the trainer's windowing (`ParallelModel.window`)
            labels = shard_window(stack_targets(labels), *model.context_shard)
        packing = _packing(batch, seq, docs_per_row)
        tracker = _LiveBytes({_storage(p)._cdata for p in model.parameters()})
        hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.exclude(p.grad))
                 for p in params]
        with tracker:
            loss, _ = model(ids, packing, labels=labels)
            saved = tracker.live
            loss.backward()
        for h in hooks:
            h.remove()
    return StepTrace(saved, tracker.peak)

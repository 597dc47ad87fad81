"""Count host synchronisations: every place a GPU would wait for the CPU, seen on a CPU run.

`HostSyncCounter` is a context manager that records, by name, two kinds of events:

- Python-level reads of tensor data on the host: `Tensor.item`, `tolist`, `cpu`, `numpy`,
  `__bool__`, `__int__`, `__float__` and `torch.equal` (patched while the counter is active);
- aten ops tagged `data_dependent_output` (`_local_scalar_dense`, `equal`, ...) or
  `dynamic_output_shape` (`nonzero`, `bincount`, `masked_select`, boolean-mask indexing, ...),
  seen through a `TorchDispatchMode`: on CUDA each of these copies data back to the host.

A custom op is one event-free node here (the mode does not look inside it), which is the rule
of `model.ops.HOST_SYNC_OPS`: an op may hide host work only where its CUDA implementation is a
library or Triton kernel. Autograd's CPU backward runs on the calling thread, so a backward
inside the context is counted too.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as c: ...` then `c.total`, `c.counts` (name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._depth = 0  # inside a patched method: its own aten call is not a second event
        self._saved: dict[str, object] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _wrap(self, name: str, fn):
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapper

    def __enter__(self):
        for name in _TENSOR_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(f"Tensor.{name}", self._saved[name]))
        self._saved["equal"] = torch.equal
        torch.equal = self._wrap("torch.equal", torch.equal)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.equal = self._saved.pop("equal")  # type: ignore[assignment]
            for name in _TENSOR_METHODS:
                setattr(torch.Tensor, name, self._saved.pop(name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth == 0 and syncs_on_device(func, args, kwargs):
            self.counts[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **kwargs)


_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")


def syncs_on_device(func, args, kwargs) -> bool:
    """Whether this aten call reads data back to the host on a GPU.

    The tags are conservative for two ops, refined here: indexing is data-dependent only with
    a boolean index (integer gathers are not), and `repeat_interleave` only without
    `output_size`. Boolean `index_put_` is counted too (it runs `nonzero` below dispatch)."""
    name = func.overloadpacket.__name__
    if name in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices or ())
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    return any(t in func.tags for t in _SYNC_TAGS)

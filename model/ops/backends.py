"""Which backend each fast op runs: the device's own choice, or every CUDA choice forced.

Ops with a fast backend (`chunk_kda`, `packed_causal_attention`, `grouped_mm`) ask
`cuda_backends_forced()` before looking at the device. `force_cuda_backends()` makes them all
take their CUDA path (fla KDA, varlen attention, `torch._grouped_mm`) whatever the device and
whether or not the library imports: under `FakeTensorMode` on CPU-device fake tensors their
custom ops' fake implementations stand in, so a CPU machine traces exactly the op graph an
H200 would run (a CPU-only torch build aborts on autograd over fake CUDA tensors).
Outside a fake-tensor trace, forcing on a CPU machine fails at the first real kernel call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_FORCED = [False]


def cuda_backends_forced() -> bool:
    """True inside `force_cuda_backends()`."""
    return _FORCED[0]


@contextlib.contextmanager
def force_cuda_backends(enabled: bool = True) -> Iterator[None]:
    """Every op picks its CUDA backend inside this context (for fake-tensor traces)."""
    old = _FORCED[0]
    _FORCED[0] = enabled
    try:
        yield
    finally:
        _FORCED[0] = old

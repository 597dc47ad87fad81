"""Which backend each fast op runs: the device's own choice, or every CUDA choice forced.

Ops with a fast backend (`chunk_kda`, `packed_causal_attention`, `grouped_mm`) ask
`cuda_backends_forced()` before looking at the device. `force_cuda_backends()` makes them all
take their CUDA path (fla KDA, varlen attention, `torch._grouped_mm`) whatever the device and
whether or not the library imports: under `FakeTensorMode` on CPU-device fake tensors their
custom ops' fake implementations stand in, so a CPU machine traces exactly the op graph an
H200 would run (a CPU-only torch build aborts on autograd over fake CUDA tensors).
Outside a fake-tensor trace, forcing on a CPU machine fails at the first real kernel call
(our own fused kernels fall back to their PyTorch formulas there instead).

Our fused kernels (AttnRes mix, SiTU-GLU, short conv, row norms, MoE combine) choose with
`fused_backend(device, dtype, env)` ("triton" on CUDA, else "torch"; `K3_*_BACKEND` overrides):
`triton_chosen(t, env)` inside their custom ops, `use_fused_kernel(t, env)` in the model to
decide whether to call the custom op at all (a constant for torch.compile); `compute_dtype` is
their maths dtype and `kernel_programs` sizes their row-strided backward grids. `cpu_run(device)`
marks code with a CPU-only formulation (a real CPU run, not a GPU trace).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

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


def fused_backend(device: torch.device, dtype: torch.dtype, env: str) -> str:
    """"triton" or "torch" for our own fused kernels (AttnRes mix, SiTU-GLU, short conv, norms,
    MoE combine).

    `env` names the override variable ("auto" by default; "torch"; "triton", which also runs on
    CPU tensors under TRITON_INTERPRET=1, how the tests check the kernels). auto: Triton on CUDA
    for 16/32-bit floats when triton imports; the PyTorch implementation otherwise (float64
    verification runs always take it). Read at run time inside the custom ops, never traced."""
    mode = os.environ.get(env, "auto")
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"{env} must be 'auto', 'torch' or 'triton', got {mode!r}")
    if mode == "torch" or dtype == torch.float64:
        return "torch"
    if mode == "triton":
        return "triton"
    return "triton" if device.type == "cuda" and _triton_imports() else "torch"


def triton_chosen(t: torch.Tensor, env: str) -> bool:
    """Whether a fused op's implementation runs its Triton kernel on `t` (else PyTorch)."""
    return fused_backend(t.device, t.dtype, env) == "triton"


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The fused ops' maths dtype for `t`: fp32, float64 staying float64."""
    return torch.promote_types(t.dtype, torch.float32)


def use_fused_kernel(t: torch.Tensor, env: str) -> bool:
    """Whether the model calls an op's custom op over our kernel (else its reference formula):
    inside `force_cuda_backends()`, or where `fused_backend` picks Triton."""
    return cuda_backends_forced() or _fused_choice(t.device, t.dtype, env)


def compile_constant(fn):
    """`torch.compiler.assume_constant_result` without importing torch._dynamo (~3 s of every
    process's start-up): the attribute it sets on `fn` in torch 2.11-2.14."""
    fn._dynamo_marked_constant = True
    return fn


@compile_constant
def cpu_run(device: torch.device) -> bool:
    """Constant for a compiled graph: a real CPU run, not a fake-tensor trace of the GPU path
    (`force_cuda_backends()`): where an op keeps a CPU-only formulation."""
    return device.type == "cpu" and not cuda_backends_forced()


@compile_constant
def _fused_choice(device: torch.device, dtype: torch.dtype, env: str) -> bool:
    """Constant for a compiled graph: the environment read stays out of it."""
    return fused_backend(device, dtype, env) == "triton"


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or driver errors raised while triton imports
        return False
    return True


def kernel_programs(device: torch.device, per_sm: int = 4) -> int:
    """How many persistent programs a row-strided kernel launches: per_sm per SM on CUDA; 2
    under TRITON_INTERPRET=1 on CPU tensors (a few programs exercise the row striding)."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 2

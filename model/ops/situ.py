"""SiTU-GLU (k3-architecture.md §4.3): bounded GLU activation used by every K3 MLP.

SiTU(g) = b1*tanh(g/b1)*sigmoid(g);  softcap(u) = b2*tanh(u/b2);  out = SiTU(gate) * softcap(up).
|out| < b1*b2 (= 100 for K3). Computed in fp32 (float64 stays float64), cast back to the input
dtype.

* `situ_glu`: the op the model calls. With the Triton backend (CUDA, 16/32-bit, or
  `K3_SITU_BACKEND=triton`; and in fake-tensor traces under `force_cuda_backends()`) it is the
  custom op `k3::situ_glu` / `k3::situ_glu_bwd` over our kernels (`model.ops.situ_triton`): one
  read of (gate, up) forward; the backward saves only the inputs and recomputes the three
  transcendentals in one pass: d gate = dout * softcap(u) * (sigmoid(g) (1 - tanh²(g/b1)) +
  b1 tanh(g/b1) sigmoid(g) (1 - sigmoid(g))), d up = dout * SiTU(g) * (1 - tanh²(u/b2)).
  Otherwise (CPU, float64) it is the reference: on a CPU the transcendentals, not the memory
  passes, are the cost, so autograd's saved intermediates beat a recomputing backward, and
  torch.compile fuses the chain itself. `K3_SITU_BACKEND=auto|torch|triton` overrides.
* `situ_glu_reference`: the formula as autograd-differentiated PyTorch ops (the oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.ops.backends import compute_dtype, triton_chosen, use_fused_kernel

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0
_ENV = "K3_SITU_BACKEND"


def situ_glu_reference(gate: Tensor, up: Tensor, beta: float = SITU_BETA,
                       linear_beta: float = SITU_LINEAR_BETA) -> Tensor:
    """SiTU(gate) * softcap(up), elementwise, autograd through the ops themselves."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(compute)
    u = up.to(compute)
    situ = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    capped = linear_beta * torch.tanh(u / linear_beta)
    return (situ * capped).to(gate.dtype)


def situ_glu(gate: Tensor, up: Tensor, beta: float = SITU_BETA,
             linear_beta: float = SITU_LINEAR_BETA) -> Tensor:
    """SiTU(gate) * softcap(up), elementwise, fp32 inside; the result in gate's dtype."""
    if gate.dtype != up.dtype:
        raise ValueError(f"gate ({gate.dtype}) and up ({up.dtype}) must share a dtype")
    if not use_fused_kernel(gate, _ENV):
        return situ_glu_reference(gate, up, beta, linear_beta)
    if gate.shape != up.shape:
        gate, up = torch.broadcast_tensors(gate, up)
    return _situ_op(gate.contiguous(), up.contiguous(), float(beta), float(linear_beta))


def _bwd_torch(dout: Tensor, gate: Tensor, up: Tensor, b1: float, b2: float
               ) -> tuple[Tensor, Tensor]:
    compute = compute_dtype(gate)
    g, u, do = gate.to(compute), up.to(compute), dout.to(compute)
    tg, sg, tu = torch.tanh(g / b1), torch.sigmoid(g), torch.tanh(u / b2)
    dsitu = (1 - tg * tg).mul_(sg).add_(b1 * tg * sg * (1 - sg))
    dgate = dsitu.mul_(tu).mul_(b2).mul_(do)
    dup = (1 - tu * tu).mul_(tg).mul_(sg).mul_(b1).mul_(do)
    return dgate, dup


@torch.library.custom_op("k3::situ_glu", mutates_args=())
def _situ_op(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU(gate) * softcap(up) in gate's dtype."""
    if triton_chosen(gate, _ENV):
        from model.ops import situ_triton

        return situ_triton.situ_fwd(gate, up, beta, linear_beta)
    return situ_glu_reference(gate, up, beta, linear_beta)  # forced off CUDA, or float64


@_situ_op.register_fake
def _(gate, up, beta, linear_beta):
    return torch.empty_like(gate)


@torch.library.custom_op("k3::situ_glu_bwd", mutates_args=())
def _situ_bwd_op(dout: Tensor, gate: Tensor, up: Tensor, beta: float, linear_beta: float
                 ) -> tuple[Tensor, Tensor]:
    """(d gate, d up) of k3::situ_glu, in the inputs' dtype."""
    if triton_chosen(gate, _ENV):
        from model.ops import situ_triton

        return situ_triton.situ_bwd(dout.contiguous(), gate, up, beta, linear_beta)
    dgate, dup = _bwd_torch(dout, gate, up, beta, linear_beta)
    return dgate.to(gate.dtype), dup.to(up.dtype)


@_situ_bwd_op.register_fake
def _(dout, gate, up, beta, linear_beta):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup(ctx, inputs, output) -> None:
    gate, up, beta, linear_beta = inputs
    ctx.save_for_backward(gate, up)
    ctx.betas = (beta, linear_beta)


def _backward(ctx, dout: Tensor):
    gate, up = ctx.saved_tensors
    dgate, dup = _situ_bwd_op(dout, gate, up, *ctx.betas)
    return dgate, dup, None, None


_situ_op.register_autograd(_backward, setup_context=_setup)

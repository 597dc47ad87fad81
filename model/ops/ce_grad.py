"""Gradient of the token cross-entropy with respect to the logits, in one pass over them.

d loss_sum / d logits[i, v] = (exp(logits[i, v] - lse[i]) - [v == labels[i]]) * scale[i], with
lse the row's log-sum-exp and scale = upstream gradient x (label != ignore). The chunked loss
(`model.loss`) calls it on a chunk's fp32 logits (in its forward by default, or on logits
recomputed in backward) and feeds the result to its two gradient GEMMs in the activation
dtype.

* `ce_logit_grad`: the op the loss calls. With the Triton backend (CUDA, 16/32-bit, or
  `K3_CE_BACKEND=triton`; and in fake-tensor traces under `force_cuda_backends()`) it is the
  custom op `k3::ce_logit_grad` over our kernel (`model.ops.ce_grad_triton`): one read of the
  fp32 logits, one write in the activation dtype, where the PyTorch form makes four passes
  (exp, the target's minus one, the scale, the cast). Otherwise (CPU, float64) the PyTorch form.
  `K3_CE_BACKEND=auto|torch|triton` overrides.
* `ce_logit_grad_reference`: the PyTorch form (the CPU path; the tests' oracle is softmax in
  float64, not this).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.ops.backends import triton_chosen, use_fused_kernel

_ENV = "K3_CE_BACKEND"


def ce_logit_grad_reference(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor,
                            out_dtype: torch.dtype) -> Tensor:
    """(exp(logits - lse) - onehot(labels)) * scale, per row, in `out_dtype`; labels < 0 have no
    target column."""
    p = torch.exp(logits - lse[:, None].to(logits.dtype))
    target = (labels >= 0).to(p.dtype)[:, None]
    p.scatter_add_(1, labels.clamp(min=0)[:, None], -target)  # a scatter, no mask index
    return (p * scale[:, None].to(p.dtype)).to(out_dtype)


def ce_logit_grad(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor,
                  out_dtype: torch.dtype) -> Tensor:
    """logits [n, V] (fp32 or fp64), lse / scale [n], labels [n] int -> [n, V] `out_dtype`."""
    if not use_fused_kernel(logits, _ENV):
        return ce_logit_grad_reference(logits, lse, labels, scale, out_dtype)
    return _ce_grad_op(logits.contiguous(), lse.float().contiguous(), labels.contiguous(),
                       scale.float().contiguous(), out_dtype)


@torch.library.custom_op("k3::ce_logit_grad", mutates_args=())
def _ce_grad_op(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor,
                out_dtype: torch.dtype) -> Tensor:
    """(exp(logits - lse) - onehot(labels)) * scale in `out_dtype`."""
    if triton_chosen(logits, _ENV):
        from model.ops import ce_grad_triton

        return ce_grad_triton.ce_grad(logits, lse, labels, scale, out_dtype)
    return ce_logit_grad_reference(logits, lse, labels, scale, out_dtype)  # forced off CUDA


@_ce_grad_op.register_fake
def _(logits, lse, labels, scale, out_dtype):
    return torch.empty(logits.shape, dtype=out_dtype, device=logits.device)

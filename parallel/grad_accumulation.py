"""Gradient-accumulation fusion under FSDP2: the weight-gradient GEMMs add into FSDP2's accumulator.

FSDP2 accumulates a bf16 weight's gradient over no-sync micro-batches in an fp32 copy of its
own (`FSDPParam.unsharded_accumulated_grad`): the GEMM writes bf16, then a cast (first
micro-batch) or an add (later ones) per tensor, 10 B per parameter per micro-batch. Here each
fusable weight (the dense projections, `model.linear.Linear`, and the routed experts' stacks,
`model.moe.RoutedExperts`) gets one persistent `main_grad` buffer in the reduce dtype; its
backward GEMM adds into it (`model.ops.wgrad`) and leaves `.grad` unset. At the start of each
step the buffers are zeroed and installed as FSDP2's accumulated gradients, so FSDP2
reduce-scatters them after the last micro-batch exactly as it would its own accumulator, and
any gradient that still arrives as `.grad` (a backend without the fused form, e.g. the padded
grouped GEMM) is added into the same buffer by FSDP2's own `accumulate_unsharded_grad_if_needed`.
This is Megatron's `gradient_accumulation_fusion` on FSDP2.

FSDP2 has no public API for it: this uses `FSDPParam.unsharded_accumulated_grad` and
`_module_info` (the same in torch 2.11-2.14; `tests/distributed/test_grad_accumulation.py`
proves the gradients equal the unfused run's on whatever torch the suite runs on). Off for a
single micro-batch (nothing to accumulate), under pipeline parallelism (the schedule runs the
micro-batches) and for DTensor (tensor-parallel), expert-parallel or MXFP8 weights; a model
with nothing fusable gets no buffers (`attach_main_grads` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from model.linear import Linear
from model.moe import RoutedExperts

_EXPERT_STACKS = ("w1", "w3", "w2")


@dataclass
class MainGrads:
    """The fused weights' accumulation buffers and the FSDP2 parameters they feed."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    fsdp_params: list = field(default_factory=list)  # FSDPParam per buffer

    def __len__(self) -> int:
        return len(self.buffers)

    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def begin_step(self) -> None:
        """Zero the buffers and make them FSDP2's accumulated gradients for this step (FSDP2
        drops its reference after the reduce-scatter of the last micro-batch)."""
        if not self.buffers:
            return
        torch._foreach_zero_(self.buffers)
        for fsdp_param, buf in zip(self.fsdp_params, self.buffers):
            fsdp_param.unsharded_accumulated_grad = buf


def _fsdp_params(model: nn.Module) -> list:
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
            if group is not None:
                out += group.fsdp_params
    return out


def fusable(module: nn.Module, name: str, experts: bool = True) -> bool:
    """Whether `module`'s parameter `name` has a fused weight-gradient GEMM: a bias-free
    `Linear`'s weight (not an MXFP8 one: another class), or (unless `experts=False`) a
    `RoutedExperts` stack on the bf16 grouped GEMM."""
    if type(module) is Linear:
        return name == "weight" and module.bias is None
    return (experts and type(module) is RoutedExperts and name in _EXPERT_STACKS
            and module.fuses_wgrad)


def _point(found: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Point each module at its buffers (the experts need all three stacks)."""
    stacks: dict[int, tuple[nn.Module, dict[str, torch.Tensor]]] = {}
    for mod, name, buf in found:
        if isinstance(mod, Linear):
            mod.main_grad = buf
        else:
            stacks.setdefault(id(mod), (mod, {}))[1][name] = buf
    for mod, bufs in stacks.values():
        if len(bufs) == len(_EXPERT_STACKS):
            mod.main_grads = tuple(bufs[n] for n in _EXPERT_STACKS)  # type: ignore[assignment]


def attach_main_grads(model: nn.Module, dtype: torch.dtype, device: torch.device,
                      experts: bool = True) -> MainGrads | None:
    """Give every fusable FSDP2-managed weight of `model` a zeroed `dtype` buffer of its
    unsharded shape (`dtype`: the reduce dtype, at least the parameters' precision) and point
    the module at it. `experts=False` (expert parallelism) leaves the expert stacks alone.
    None when nothing is fusable (no FSDP2 units, tensor-parallel or MXFP8 weights)."""
    mains, found = MainGrads(), []
    for fp in _fsdp_params(model):
        mod, name = fp._module_info.module, fp._module_info.param_name
        if fp.is_dtensor or not fusable(mod, name, experts):
            continue
        buf = torch.zeros(fp._orig_size, dtype=dtype, device=device)
        found.append((mod, name, buf))
        mains.buffers.append(buf)
        mains.fsdp_params.append(fp)
    _point(found)
    return mains if len(mains) else None


def attach_local_main_grads(model: nn.Module, dtype: torch.dtype | None = None
                            ) -> dict[str, torch.Tensor]:
    """The same buffers on a model without FSDP2 (fake-tensor traces, tests): parameter name ->
    zeroed buffer like the parameter (in `dtype` if given); the caller reads them."""
    out, found = {}, []
    for mname, mod in model.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            if fusable(mod, name):
                buf = torch.zeros_like(p, dtype=dtype, requires_grad=False)
                out[f"{mname}.{name}" if mname else name] = buf
                found.append((mod, name, buf))
    _point(found)
    return out

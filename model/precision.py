"""Low-precision GEMM recipes applied to a built model: `apply_mxfp8`.

MXFP8 goes only on the GEMMs K3 would quantise (k3-architecture.md §6.2, §6.6): routed experts
(grouped GEMM), shared experts, the dense MLP, and optionally the attention projections (KDA
q/k/v/g/o, MLA q/kv/g/o). It never touches the router, norms, AttnRes, the KDA gate/beta
projections and state, the latent down/up projections, the embedding or the LM head. Applied on
a single-device (or meta) model before sharding: it swaps `nn.Linear` classes and the routed
experts' GEMM function, so parameters, names and checkpoints are unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from model.kda import KimiDeltaAttention
from model.mla import GatedMLA
from model.mlp import SiTUMLP
from model.moe import LatentMoE, RoutedExperts
from model.ops.mx_linear import mx_grouped_mm, mx_linear

MXFP8_TARGETS = ("routed_experts", "shared_experts", "dense_mlp", "attention")
ATTENTION_PROJECTIONS = {
    KimiDeltaAttention: ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"),
    GatedMLA: ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj",
               "o_proj"),
}


class MXLinear(nn.Linear):
    """nn.Linear whose GEMMs run in MXFP8 (fprop, dgrad, wgrad each on its contraction axis)."""

    mx_mode: str = "rceil"
    wgrad_hp: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = mx_linear(x, self.weight, wgrad_hp=self.wgrad_hp, mode=self.mx_mode)
        return y if self.bias is None else y + self.bias

    @classmethod
    def convert(cls, linear: nn.Linear, mode: str, wgrad_hp: bool) -> None:
        linear.__class__ = cls
        linear.mx_mode, linear.wgrad_hp = mode, wgrad_hp


def apply_mxfp8(model: nn.Module, targets: list[str] | tuple[str, ...] = MXFP8_TARGETS[:3],
                mode: str = "rceil", wgrad_hp: bool = False) -> list[str]:
    """Switch the chosen GEMMs to MXFP8; returns the names of the converted modules."""
    unknown = sorted(set(targets) - set(MXFP8_TARGETS))
    if unknown:
        raise ValueError(f"unknown MXFP8 target(s) {unknown}; choose from {list(MXFP8_TARGETS)}")
    done: list[str] = []

    def linears(parent: nn.Module, prefix: str, names: tuple[str, ...]) -> None:
        for n in names:
            sub = getattr(parent, n, None)
            if isinstance(sub, nn.Linear):
                MXLinear.convert(sub, mode, wgrad_hp)
                done.append(f"{prefix}.{n}")

    mlp_names = ("gate_proj", "up_proj", "down_proj")
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts) and "routed_experts" in targets:
            module.gemm = functools.partial(mx_grouped_mm, wgrad_hp=wgrad_hp, mode=mode)
            done.append(name)
        elif isinstance(module, LatentMoE) and "shared_experts" in targets:
            if module.shared_experts is not None:
                linears(module.shared_experts, f"{name}.shared_experts", mlp_names)
        elif isinstance(module, SiTUMLP) and name.endswith(".mlp") and "dense_mlp" in targets:
            linears(module, name, mlp_names)
        elif type(module) in ATTENTION_PROJECTIONS and "attention" in targets:
            linears(module, name, ATTENTION_PROJECTIONS[type(module)])
    return done

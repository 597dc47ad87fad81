"""Weight initialisation and dtype policy, in one place.

`init_weights(model, seed)` is the only source of initial values: every parameter gets its own
generator seeded from (seed, parameter name), so a model built directly and one materialised from
the meta device get identical weights, whatever the construction order. Rules (k3-architecture.md
§9 open question 1, our proposal): normal(0, initializer_range) for linears, experts, router and
embedding; ones for norm weights; zeros for AttnRes pseudo-queries; fla's init for A_log/dt_bias;
Conv1d's default uniform bound for the short convs; all buffers (router bias, QB counts) zero.

`FP32_PARAM_SUFFIXES` lists what K3 keeps in fp32 when the rest of the model is cast down.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from model.kda import KimiDeltaAttention
from model.moe import RoutedExperts, Router
from model.norms import RMSNorm
from model.short_conv import ShortConv

FP32_PARAM_SUFFIXES = (
    "A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "gate.weight",
    "_res_norm.weight", "_res_proj.weight",
)


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return gen


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    std = model.config.initializer_range  # type: ignore[union-attr]
    done: set[str] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue

        def gen(pname: str, prefix: str = prefix, own: dict = own) -> torch.Generator:
            return param_generator(seed, prefix + pname, own[pname].device)

        if isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, ShortConv):
            module.reset_parameters(gen("weight"))
        elif isinstance(module, nn.Linear) and mod_name.endswith("_res_proj"):
            module.weight.zero_()  # AttnRes pseudo-query: uniform depth average at step 0
        elif isinstance(module, KimiDeltaAttention):
            module.reset_gate_parameters(gen("dt_bias"))
        elif isinstance(module, (nn.Linear, nn.Embedding, Router, RoutedExperts)):
            for pname, p in own.items():
                p.normal_(0.0, std, generator=gen(pname))
        else:
            raise TypeError(f"init_weights has no rule for {type(module).__name__} ({mod_name})")
        done.update(prefix + p for p in own)
    missing = [n for n, _ in model.named_parameters() if n not in done]
    if missing:
        raise RuntimeError(f"init_weights left parameters uninitialised: {missing[:5]}")
    for buf in model.buffers():
        buf.zero_()
    return model


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters to `dtype`, keeping K3's fp32 parameters (and buffers) in fp32."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not keeps_fp32(name):
            p.data = p.data.to(dtype)
    return model

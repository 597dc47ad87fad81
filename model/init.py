"""Weight initialisation and dtype policy, in one place.

`init_weights(model, seed)` is the only source of initial values. Every parameter is filled as a
full (unsharded) tensor from its own generator, seeded from (seed, parameter name), and handed to
`write(param, full)`. So a model built directly, one materialised from the meta device, and one
sharded by `parallel/` (which passes a writer that keeps only the local shard) all get the same
weights. Rules (k3-architecture.md §9 open question 1, our proposal): normal(0, initializer_range)
for linears, experts, router and embedding; ones for norm weights; zeros for AttnRes
pseudo-queries; [0 .. 0 I] for the MTP's AttnRes-feature projection (`model.mtp`); fla's init
for A_log/dt_bias; Conv1d's default uniform bound for the short convs; all buffers (router bias,
QB counts, loads) zero.

`FP32_PARAM_SUFFIXES` lists what K3 keeps in fp32 when the rest of the model is cast down.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from model.kda import KimiDeltaAttention
from model.norms import RMSNorm
from model.short_conv import ShortConv

FP32_PARAM_SUFFIXES = (
    "A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "gate.weight",
    "_res_norm.weight", "_res_proj.weight",
)

Writer = Callable[[torch.Tensor, torch.Tensor], None]


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


def _copy(param: torch.Tensor, full: torch.Tensor) -> None:
    param.copy_(full)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return gen


def _fill(module: nn.Module, mod_name: str, pname: str, full: torch.Tensor,
          gen: torch.Generator, std: float) -> None:
    """Write the initial value of `module.<pname>` into `full` (its full shape)."""
    if isinstance(module, RMSNorm):
        full.fill_(1.0)
    elif isinstance(module, ShortConv):
        bound = module.kernel_size ** -0.5  # nn.Conv1d's default bound for a depthwise conv
        full.uniform_(-bound, bound, generator=gen)
    elif mod_name.endswith("_res_proj"):
        full.zero_()  # AttnRes pseudo-query: a uniform depth average at step 0
    elif mod_name.endswith("mtp.h_proj"):  # [0 ... 0 I]: the MTP input is the final state
        full.zero_()
        d = full.shape[0]
        full[:, -d:] = torch.eye(d)
    elif isinstance(module, KimiDeltaAttention) and pname == "A_log":
        if module.lower_bound is None:  # fla: log U[1, 16]; zeros with the lower-bound gate
            full.copy_(torch.empty_like(full).uniform_(1, 16, generator=gen).log())
        else:
            full.zero_()
    elif isinstance(module, KimiDeltaAttention) and pname == "dt_bias":
        u = torch.empty_like(full).uniform_(generator=gen)  # dt = exp(U[log 1e-3, log 0.1])
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        full.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    else:
        full.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, write: Writer = _copy) -> nn.Module:
    """Initialise every parameter and zero every buffer; `write(param, full_value)` stores."""
    std = model.config.initializer_range  # type: ignore[union-attr]
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            full = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            _fill(module, mod_name, pname, full, _generator(seed, name, full.device), std)
            write(p, full.to(p.dtype))
    for buf in model.buffers():
        buf.zero_()
    return model


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters to `dtype`, keeping K3's fp32 parameters (and buffers) in fp32."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not keeps_fp32(name):
            p.data = p.data.to(dtype)
    return model

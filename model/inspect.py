"""`python -m model.inspect <preset>`: one JSON object describing a model config, built on meta.

Keys: total_params, active_params (per token: routed experts counted top-k/E, input embedding
excluded, LM head included — the convention of K3's "104.2B activated"), n_layers, layer_types,
plus a per-component breakdown and the AttnRes schedule. Nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from model.build import build_model
from model.config import ConfigError, load_model_config
from model.moe import RoutedExperts


def count_params(model: torch.nn.Module) -> dict[str, int]:
    cfg = model.config  # type: ignore[union-attr]
    total = active = routed = embed = 0
    for mod in model.modules():
        n = sum(p.numel() for p in mod.parameters(recurse=False))
        total += n
        if isinstance(mod, RoutedExperts):
            routed += n
            active += n * cfg.num_experts_per_token // cfg.num_experts
        elif isinstance(mod, torch.nn.Embedding):
            embed += n
        else:
            active += n
    return {"total_params": total, "active_params": active, "routed_expert_params": routed,
            "embedding_params": embed}


def describe(name: str) -> dict[str, Any]:
    cfg = load_model_config(name)
    t0 = time.perf_counter()
    model = build_model(cfg, device="meta")
    build_s = time.perf_counter() - t0
    counts = count_params(model)
    snaps = cfg.attn_res_snapshot_layers
    by_type: dict[str, int] = {}
    for layer in model.layers.values():
        n = sum(p.numel() for p in layer.self_attn.parameters())
        by_type[layer.layer_type] = n
    return {
        "preset": name,
        **counts,
        "total_params_h": f"{counts['total_params'] / 1e12:.3f}T"
        if counts["total_params"] >= 1e12 else f"{counts['total_params'] / 1e9:.3f}B",
        "active_params_h": f"{counts['active_params'] / 1e9:.2f}B",
        "n_layers": cfg.num_hidden_layers,
        "layer_types": cfg.layer_types,
        "mla_layers_1based": sorted(cfg.full_attn_layers),
        "n_kda_layers": cfg.layer_types.count("kda"),
        "n_mla_layers": cfg.layer_types.count("mla"),
        "token_mixer_params": by_type,
        "dense_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)],
        "attn_res_snapshot_layers": snaps,
        "attn_res_final_sources": len(snaps) + 1,
        "experts": {"routed": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                    "shared": cfg.num_shared_experts, "latent": cfg.routed_expert_hidden_size},
        "meta_build_seconds": round(build_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.inspect", description=__doc__)
    ap.add_argument("preset", help="model preset name (configs/model/<name>.yaml) or YAML path")
    args = ap.parse_args(argv)
    try:
        info = describe(args.preset)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

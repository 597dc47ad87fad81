"""`python -m model.inspect <preset> [field=value ...]`: one JSON object describing a model
config, built on meta.

Keys: total_params, active_params (per token: routed experts counted top-k/E, input embedding
excluded, LM head included — the convention of K3's "104.2B activated"), n_layers, layer_types,
plus a per-component breakdown and the AttnRes schedule. The MTP module
(`num_nextn_predict_layers=1`) is counted apart, in mtp_params / mtp_active_params (its own
tensors; it shares the embedding and LM head), never in the totals. Nothing is allocated.
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
    total = active = routed = embed = mtp = mtp_active = 0
    for name, mod in model.named_modules():
        n = sum(p.numel() for p in mod.parameters(recurse=False))
        a = n * cfg.num_experts_per_token // cfg.num_experts if isinstance(mod, RoutedExperts) \
            else 0 if isinstance(mod, torch.nn.Embedding) else n
        if name == "mtp" or name.startswith("mtp."):
            mtp += n
            mtp_active += a
            continue
        total += n
        active += a
        if isinstance(mod, RoutedExperts):
            routed += n
        elif isinstance(mod, torch.nn.Embedding):
            embed += n
    return {"total_params": total, "active_params": active, "routed_expert_params": routed,
            "embedding_params": embed, "mtp_params": mtp, "mtp_active_params": mtp_active}


def describe(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = load_model_config(name, **(overrides or {}))
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


def parse_model_overrides(items: list[str]) -> dict[str, Any]:
    """`field=value` (or `model.field=value`) items as ModelConfig fields, YAML values."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not field=value, e.g. "
                              "num_nextn_predict_layers=1")
        out[key.removeprefix("model.")] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.inspect", description=__doc__)
    ap.add_argument("preset", help="model preset name (configs/model/<name>.yaml) or YAML path")
    ap.add_argument("overrides", nargs="*", metavar="field=value",
                    help="model fields to change, YAML values (num_nextn_predict_layers=1)")
    args = ap.parse_args(argv)
    try:
        info = describe(args.preset, parse_model_overrides(args.overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

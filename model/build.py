"""Build a K3 model from a preset: directly on a device, or on meta and materialised later."""

from __future__ import annotations

import torch

from model.config import ModelConfig, load_model_config
from model.decoder import K3Model
from model.init import init_weights


def build_model(cfg: ModelConfig | str, device: torch.device | str = "cpu", seed: int = 0,
                dtype: torch.dtype | None = None) -> K3Model:
    """Construct and initialise. `device="meta"` builds shapes only (call `materialize` later)."""
    if isinstance(cfg, str):
        cfg = load_model_config(cfg)
    model = K3Model(cfg, device=device)
    if torch.device(device).type != "meta":
        init_weights(model, seed)
    if dtype is not None:
        from model.init import cast_model

        cast_model(model, dtype)
    return model


def materialize(model: K3Model, device: torch.device | str, seed: int = 0) -> K3Model:
    """Allocate a meta-built model on `device` and initialise it exactly as `build_model` would."""
    model.to_empty(device=device)
    return init_weights(model, seed)

"""Tiny model configs for unit tests (the `debug` preset and variations of it)."""

from __future__ import annotations

import dataclasses

import torch

from model.build import build_model
from model.config import ModelConfig, load_model_config


def debug_config(**overrides) -> ModelConfig:
    return dataclasses.replace(load_model_config("debug"), **overrides).validate()


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    model = build_model(debug_config(**overrides), seed=seed)
    return model.to(dtype) if dtype != torch.float32 else model

"""Shared pytest setup: one intra-op thread (test tensors are tiny; OpenMP only adds overhead and
makes timings erratic on a busy 2-core CI box), the repo root importable, and every test seeded
(an unseeded float32 comparison once failed CI on a draw its tolerance did not cover)."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seeded():
    """Each test starts from the same random state, whatever ran before it."""
    torch.manual_seed(0)
    random.seed(0)

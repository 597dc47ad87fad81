"""Shared pytest setup: one intra-op thread (test tensors are tiny; OpenMP only adds overhead and
makes timings erratic on a busy 2-core CI box), and the repo root importable."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)

"""`train.checkpoint.sample.next_token`: greedy at temperature 0; nucleus sampling never leaves the
smallest set of most likely tokens reaching top_p, and draws them in proportion."""

from __future__ import annotations

import math

import torch

from train.checkpoint.sample import next_token


def test_greedy_and_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    assert next_token(logits, 0.0, 0.9) == 1
    g = torch.Generator().manual_seed(0)
    draws = [next_token(logits, 1.0, 0.7, g) for _ in range(2000)]
    assert set(draws) == {1, 3}  # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 are cut
    share = draws.count(1) / len(draws)
    assert abs(share - 0.5 / 0.8) < 4 * math.sqrt(0.625 * 0.375 / 2000)
    assert {next_token(logits, 1.0, 0.01, g) for _ in range(50)} == {1}  # top_p below p_max

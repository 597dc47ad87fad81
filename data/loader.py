"""Deterministic, resumable, reshardable batches for data-parallel training.

The global sample stream is a function of (seed, global position) only: position p is sample
`perm(seed, epoch)[p % N]` with epoch = p // N and `perm` = `np.random.default_rng([seed, epoch])
.permutation(N)`. An optimizer step consumes `global_batch` consecutive positions; data rank r
takes the contiguous slice [r*G/D, (r+1)*G/D) and splits it into micro-batches. The checkpointed
state is the global position, so a run saved with one DP size resumes with any other and consumes
the same samples in the same steps (no skip, no repeat).

Loss normalisation: each micro-batch reports `num_target_tokens` (labels != -100); the trainer sums
them over its micro-batches (`local_target_tokens`) and all-reduces (SUM) across data ranks to get
the global count that divides every micro-batch's loss sum.

Deliberately not here: torch.distributed (the trainer passes dp_rank/dp_size and reduces counts),
background prefetch threads, moving tensors to a device.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from data.dataset import IGNORE_INDEX
from model.packing import cu_seqlens_from_doc_ids  # the model's document-boundary convention


class SampleSource(Protocol):
    seq_len: int

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> dict: ...


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """[num_samples] int64: the order of samples in `epoch`."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def local_target_tokens(step_batches: list[dict]) -> int:
    """Target tokens of this rank in one step; all-reduce (SUM) over data ranks for the global."""
    return int(sum(int(b["num_target_tokens"]) for b in step_batches))


class BatchLoader:
    """Yields, per optimizer step, this data rank's micro-batches of the global batch."""

    def __init__(self, dataset: SampleSource, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int) -> None:
        G, mb, D = global_batch, micro_batch, dp_size
        if D < 1 or not 0 <= dp_rank < D:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={D})")
        if G < 1 or mb < 1:
            raise ValueError(f"data.global_batch={G} and data.micro_batch={mb} must be positive")
        if G % D:
            raise ValueError(f"data.global_batch={G} is not divisible by dp_size={D}; "
                             f"use a multiple of {D}")
        if (G // D) % mb:
            raise ValueError(f"data.global_batch/dp_size={G // D} is not divisible by "
                             f"data.micro_batch={mb}; use a micro_batch dividing {G // D}")
        if len(dataset) < 1:
            raise ValueError("the dataset holds no full sample; prepare more text or lower "
                             "seq_len")
        self.dataset, self.seed = dataset, seed
        self.global_batch, self.micro_batch = G, mb
        self.dp_rank, self.dp_size = dp_rank, D
        self.samples_per_rank = G // D
        self.grad_accum_steps = self.samples_per_rank // mb
        self.num_samples = len(dataset)
        self.position = 0  # global position of the next step's first sample
        self._perms: dict[int, np.ndarray] = {}  # epoch -> permutation (the last two epochs)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = epoch_permutation(self.seed, epoch, self.num_samples)
        return self._perms[epoch]

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global positions [n] -> dataset sample ids [n] int64."""
        N = self.num_samples
        epochs = positions // N  # [n]
        ids = np.empty(positions.size, dtype=np.int64)  # [n]
        for e in np.unique(epochs):
            here = epochs == e
            ids[here] = self._perm(int(e))[positions[here] % N]
        return ids

    def rank_positions(self, step_start: int) -> np.ndarray:
        """[G/D] global positions this rank reads in the step that starts at `step_start`."""
        first = step_start + self.dp_rank * self.samples_per_rank
        return np.arange(first, first + self.samples_per_rank, dtype=np.int64)

    def next_step(self) -> list[dict]:
        """This rank's `grad_accum_steps` micro-batches of the next optimizer step."""
        ids = self.sample_ids(self.rank_positions(self.position))  # [G/D]
        self.position += self.global_batch
        return [self._collate(ids[k:k + self.micro_batch])
                for k in range(0, ids.size, self.micro_batch)]

    def _collate(self, ids: np.ndarray) -> dict:
        samples = [self.dataset[int(i)] for i in ids]
        labels = torch.stack([s["labels"] for s in samples])  # [mb, T]
        return {
            "input_ids": torch.stack([s["input_ids"] for s in samples]),  # [mb, T] int64
            "labels": labels,
            "cu_seqlens": cu_seqlens_from_doc_ids(torch.stack([s["doc_ids"] for s in samples])),
            "sample_ids": torch.from_numpy(ids.copy()),  # [mb] int64
            "num_target_tokens": int((labels != IGNORE_INDEX).sum()),
        }

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "global_batch": self.global_batch,
                "num_samples": self.num_samples}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at a global position; the DP layout (and global batch) may differ."""
        if sd["seed"] != self.seed:
            raise ValueError(f"data loader state has seed {sd['seed']} but data.seed={self.seed};"
                             f" set data.seed={sd['seed']} to resume this run")
        n = sd.get("num_samples", self.num_samples)
        if n != self.num_samples:
            raise ValueError(f"data loader state was written for {n} samples but the dataset "
                             f"has {self.num_samples}; resume with the same corpus and seq_len")
        self.position = int(sd["position"])

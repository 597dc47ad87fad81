"""Deterministic, resumable, reshardable batches for data-parallel training.

The global sample stream is a function of (seed, global position) only: position p is sample
`perm(seed, epoch)[p % N]` with epoch = p // N and `perm` = `np.random.default_rng([seed, epoch])
.permutation(N)`. An optimizer step consumes `global_batch` consecutive positions; data rank r
takes the contiguous slice [r*G/D, (r+1)*G/D) and splits it into micro-batches. The checkpointed
state is the global position, so a run saved with one DP size resumes with any other and consumes
the same samples in the same steps (no skip, no repeat).

Block shuffling (`block_tokens`, `data.shuffle_block_tokens`): the order is shuffled in fixed
blocks of the token stream instead of single windows. Position p (in windows of T tokens) is
window p % (S/T) of block `perm(seed, epoch)[q % n_blocks]`, q = p // (S/T), over n_blocks whole
blocks of S tokens. A block holds the same tokens whatever T divides S, so a run resumed at
another sequence length (a context-length stage) continues at the same token of the same block:
the state converts to tokens and back (to the next block's start, with a note, only if the new
T does not divide the tokens consumed).

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
                 dp_rank: int, dp_size: int, seed: int, block_tokens: int | None = None
                 ) -> None:
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
            raise ValueError(f"the dataset ({dataset.total_tokens} tokens) holds no full "
                             f"window of data.seq_len={dataset.seq_len} + 1 tokens; prepare "
                             "more text or lower data.seq_len")
        self.dataset, self.seed = dataset, seed
        self.global_batch, self.micro_batch = G, mb
        self.dp_rank, self.dp_size = dp_rank, D
        self.samples_per_rank = G // D
        self.grad_accum_steps = self.samples_per_rank // mb
        self.seq_len, self.block_tokens = dataset.seq_len, block_tokens
        self.windows_per_block = 1  # shuffled units: single windows, or blocks of them
        if block_tokens is not None:
            T = dataset.seq_len
            if block_tokens < T or block_tokens % T:
                raise ValueError(f"data.shuffle_block_tokens={block_tokens} must be a multiple "
                                 f"of data.seq_len={T}; use e.g. {T * max(1, block_tokens // T)}")
            self.windows_per_block = block_tokens // T
        self.num_units = len(dataset) // self.windows_per_block  # whole blocks only
        if self.num_units < 1:
            raise ValueError(f"the dataset holds less than one shuffle block of {block_tokens} "
                             "tokens; prepare more text or lower data.shuffle_block_tokens")
        self.num_samples = self.num_units * self.windows_per_block  # windows per epoch
        self.position = 0  # global position of the next step's first sample
        self.resume_note: str | None = None  # where a resume at another seq_len continued
        self._perms: dict[int, np.ndarray] = {}  # epoch -> permutation (the last two epochs)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = epoch_permutation(self.seed, epoch, self.num_units)
        return self._perms[epoch]

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global positions [n] -> dataset sample ids [n] int64."""
        w = self.windows_per_block
        units, inside = positions // w, positions % w  # [n]: the block (or window), its window
        epochs = units // self.num_units  # [n]
        ids = np.empty(positions.size, dtype=np.int64)  # [n]
        for e in np.unique(epochs):
            here = epochs == e
            ids[here] = self._perm(int(e))[units[here] % self.num_units] * w + inside[here]
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
                "num_samples": self.num_samples, "seq_len": self.seq_len,
                "block_tokens": self.block_tokens, "num_units": self.num_units}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at a global position; the DP layout (and global batch) may differ, and with
        block shuffling the sequence length too (the position is carried over in tokens)."""
        if sd["seed"] != self.seed:
            raise ValueError(f"data loader state has seed {sd['seed']} but data.seed={self.seed};"
                             f" set data.seed={sd['seed']} to resume this run")
        T_old = sd.get("seq_len", self.seq_len)
        if sd.get("block_tokens") != self.block_tokens:
            raise ValueError(f"data loader state was written with data.shuffle_block_tokens="
                             f"{sd.get('block_tokens')}; resume with the same value")
        if T_old != self.seq_len and self.block_tokens is None:
            raise ValueError(f"data loader state was written at data.seq_len={T_old}; resume "
                             "at that length, or set data.shuffle_block_tokens (from the run's "
                             "start) to change it")
        n, mine = ((sd.get("num_samples"), self.num_samples) if self.block_tokens is None
                   else (sd.get("num_units"), self.num_units))
        if n is not None and n != mine:
            raise ValueError(f"data loader state was written for {n} shuffle units but the "
                             f"dataset has {mine}; resume with the same corpus")
        if T_old == self.seq_len:
            self.position = int(sd["position"])
            return
        tokens = int(sd["position"]) * T_old
        S = self.block_tokens
        if tokens % self.seq_len:  # continue at the next block's first token
            blocks = -(-tokens // S)
            self.position = blocks * self.windows_per_block
            skipped = blocks * S - tokens
        else:
            self.position, skipped = tokens // self.seq_len, 0
        at = self.position * self.seq_len
        self.resume_note = (f"data: seq_len {T_old} -> {self.seq_len}: continues at token {at} "
                            f"of the block stream (block {at // S}, offset {at % S}"
                            + (f"; {skipped} tokens of the last block skipped" if skipped else "")
                            + ")")

"""A prepared token folder seen as fixed-length training windows over one packed token stream.

All shards (manifest order) are memory-mapped and concatenated into one stream. Sample i is the
window of tokens [i*T, i*T + T + 1): inputs are its first T tokens, labels the next T. A label is
-100 where the label token starts a new document (the model never predicts across a boundary), and
`doc_ids` numbers the documents inside the window from 0, so packing (cu_seqlens) follows.

Deliberately not here: shuffling, batching, data-parallel slicing (all in `data.loader`), and
padding: windows ignore document boundaries, documents are cut across windows as they fall.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data.shards import MANIFEST, read_json
from model.loss import IGNORE_INDEX  # the label the model ignores


def load_manifest(folder: str | Path) -> dict:
    """The manifest of a finished preparation; ValueError naming `python -m data.prepare` if not."""
    m = read_json(Path(folder) / MANIFEST)
    if m is None or not m.get("complete"):
        raise ValueError(f"{folder} holds no complete {MANIFEST}; "
                         f"run `python -m data.prepare INPUT... --output {folder}` first")
    return m


class PackedTokenDataset:
    """Fixed windows of `seq_len`+1 tokens over all shards of a prepared folder."""

    def __init__(self, folder: str | Path, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.folder, self.seq_len = Path(folder), seq_len
        self.manifest = load_manifest(folder)
        dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self._shards: list[np.ndarray] = []
        doc_starts: list[np.ndarray] = []
        shard_starts = [0]  # global token offset of each shard, then the total
        for s in self.manifest["shards"]:
            n = s["num_tokens"]
            path = self.folder / s["tokens"]
            if path.stat().st_size != n * dtype.itemsize:
                raise ValueError(f"{path} does not hold {n} tokens as the manifest says; "
                                 "re-run `python -m data.prepare ... --overwrite`")
            self._shards.append(np.memmap(path, dtype=dtype, mode="r", shape=(n,)))
            doc_starts.append(np.load(self.folder / s["docs"]) + shard_starts[-1])
            shard_starts.append(shard_starts[-1] + n)
        self._shard_starts = np.asarray(shard_starts, dtype=np.int64)  # [n_shards + 1]
        self.doc_starts = np.concatenate(doc_starts).astype(np.int64)  # [n_docs] global offsets
        self.total_tokens = int(self._shard_starts[-1])
        self.eos_id = int(self.manifest["eos_id"])
        self.vocab_size = int(self.manifest["vocab_size"])

    def __len__(self) -> int:
        return max(0, (self.total_tokens - 1) // self.seq_len)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global tokens [start, stop) as int64, read across shard boundaries."""
        first = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        parts, pos = [], start
        for k in range(first, len(self._shards)):
            if pos >= stop:
                break
            base = int(self._shard_starts[k])
            end = min(stop, int(self._shard_starts[k + 1]))
            parts.append(self._shards[k][pos - base:end - base])
            pos = end
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict:
        n, T = len(self), self.seq_len
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i = i % n
        start = i * T
        window = self.tokens(start, start + T + 1)  # [T+1]
        pos = np.arange(start, start + T + 1, dtype=np.int64)  # [T+1] global token positions
        doc = np.searchsorted(self.doc_starts, pos, side="right") - 1  # [T+1] global doc index
        labels = window[1:].copy()  # [T]
        labels[doc[1:] != doc[:-1]] = IGNORE_INDEX  # label token opens a new document
        return {
            "input_ids": torch.from_numpy(window[:-1].copy()),  # [T] int64
            "labels": torch.from_numpy(labels),  # [T] int64
            "doc_ids": torch.from_numpy(doc[:-1] - doc[0]),  # [T] int64, 0 at the first token
            "sample_id": i,
        }

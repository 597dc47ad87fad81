"""The on-disk token format and its crash-safe, resumable writer.

Layout of a prepared folder:
  tokens-00000.bin  raw little-endian token ids (uint16, or uint32 for vocabularies over 65535)
  docs-00000.npy    int64 start offset of every document inside that shard (first is 0)
  manifest.json     written last: its presence with `complete: true` means the folder is usable
  .progress.json    the journal while preparing (removed at the end)

Documents never straddle shards: a shard is closed before a document that would overflow it, and a
document longer than `shard_tokens` gets a shard of its own. The open shard lives under temp names
(`*.tmp`, doc offsets as raw int64); the journal records, after each input file, how many bytes of
them are committed. A shard closed while processing a file is renamed to its final names only
after the journal commit that covers it, so a resume can always truncate back to the journal state.

Deliberately not here: reading input files (`data.sources`) and the dataset view (`data.dataset`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = ".progress.json"
# tokens-00000.bin(.tmp), docs-00000.npy(.tmp), docs-00000.idx.tmp; group 1 is the shard index
SHARD_FILE = re.compile(r"^(?:tokens|docs)-(\d{5,})\.(?:bin|npy|idx)(?:\.tmp)?$")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def tokens_name(i: int) -> str:
    return f"tokens-{i:05d}.bin"


def docs_name(i: int) -> str:
    return f"docs-{i:05d}.npy"


def is_ours(name: str) -> bool:
    """Files that prepare writes (and that --overwrite may delete)."""
    return (name in (MANIFEST, JOURNAL, f"{MANIFEST}.tmp", f"{JOURNAL}.tmp")
            or SHARD_FILE.match(name) is not None)


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class ShardWriter:
    """Appends documents to shards; `commit` makes everything so far survive a crash."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, fingerprint: str,
                 journal: dict | None = None, own_journal: bool = True) -> None:
        """`own_journal=False`: a second writer (the validation split) whose state the first
        writer's journal carries (`commit(..., extra=)`), so both commit in one rename."""
        self.out, self.dtype, self.shard_tokens = out, np.dtype(dtype), shard_tokens
        self.fingerprint, self.own_journal = fingerprint, own_journal
        j = journal or {"next_file": 0, "shards": [], "open": {"num_tokens": 0, "num_docs": 0}}
        self.next_file: int = j["next_file"]
        self.shards: list[dict] = [dict(s) for s in j["shards"]]  # closed: num_tokens, num_docs
        self.open_tokens: int = j["open"]["num_tokens"]
        self.open_docs: int = j["open"]["num_docs"]
        self._pending: list[int] = list(range(len(self.shards)))  # closed, maybe not yet renamed
        if journal is None and own_journal:  # claim the folder first, so an early crash resumes
            write_json_atomic(self.out / JOURNAL, self.journal())
        self._finalize_pending()
        self._discard_uncommitted()
        self._open_temp_files()

    # -- temp names of shard i
    def _tok_tmp(self, i: int) -> Path:
        return self.out / (tokens_name(i) + ".tmp")

    def _doc_tmp(self, i: int) -> Path:
        return self.out / (f"docs-{i:05d}.idx.tmp")

    @property
    def open_index(self) -> int:
        return len(self.shards)

    def _discard_uncommitted(self) -> None:
        """Delete shard files beyond the journal; truncate the open shard to its committed size."""
        for f in self.out.iterdir():
            m = SHARD_FILE.match(f.name)
            if m:
                i = int(m.group(1))
                keep = (self._tok_tmp(i).name, self._doc_tmp(i).name)
                if i > self.open_index or (i == self.open_index and f.name not in keep):
                    f.unlink()
        i = self.open_index
        for path, n_bytes in ((self._tok_tmp(i), self.open_tokens * self.dtype.itemsize),
                              (self._doc_tmp(i), self.open_docs * 8)):
            have = path.stat().st_size if path.exists() else 0
            if have < n_bytes:
                raise OSError(f"{path} holds {have} bytes but the journal committed {n_bytes}; "
                              "the folder is damaged: re-run with --overwrite")
            if path.exists():
                os.truncate(path, n_bytes)

    def _open_temp_files(self) -> None:
        self._tok_f = open(self._tok_tmp(self.open_index), "ab")
        self._doc_f = open(self._doc_tmp(self.open_index), "ab")

    def add(self, tokens: np.ndarray, doc_lens: np.ndarray) -> None:
        """Append one file's documents (tokens [sum(doc_lens)], doc_lens [n_docs])."""
        offsets = np.zeros(doc_lens.size + 1, dtype=np.int64)  # doc starts within `tokens`
        np.cumsum(doc_lens, out=offsets[1:])
        pos, n_docs = 0, doc_lens.size
        while pos < n_docs:
            room = self.shard_tokens - self.open_tokens
            # last k such that docs [pos, k) fit into the room left in the open shard
            k = int(np.searchsorted(offsets, offsets[pos] + room, side="right")) - 1
            if k <= pos:
                if self.open_tokens > 0:
                    self._close_shard()
                    continue
                k = pos + 1  # a document longer than a shard: alone in a fresh shard
            starts = offsets[pos:k] - offsets[pos] + self.open_tokens  # [k-pos] shard offsets
            self._tok_f.write(tokens[offsets[pos]:offsets[k]].astype(self.dtype, copy=False)
                              .tobytes())
            self._doc_f.write(starts.astype("<i8").tobytes())
            self.open_tokens += int(offsets[k] - offsets[pos])
            self.open_docs += k - pos
            pos = k

    def _close_shard(self) -> None:
        self._tok_f.close()
        self._doc_f.close()
        self.shards.append({"num_tokens": self.open_tokens, "num_docs": self.open_docs})
        self._pending.append(len(self.shards) - 1)
        self.open_tokens = self.open_docs = 0
        self._open_temp_files()

    def commit(self, next_file: int, extra: dict | None = None) -> None:
        """Record that input files [0, next_file) are fully written (with `extra` in the
        journal); then rename closed shards. Without an own journal: flush only, and the
        owner's commit is followed by `finalize`."""
        self._tok_f.flush()
        self._doc_f.flush()
        self.next_file = next_file
        if self.own_journal:
            write_json_atomic(self.out / JOURNAL, {**self.journal(), **(extra or {})})
            self._finalize_pending()

    def finalize(self) -> None:
        """After the owning writer's journal commit: rename this writer's closed shards."""
        self._finalize_pending()

    @property
    def num_docs(self) -> int:
        """Documents written so far (closed shards and the open one)."""
        return sum(s["num_docs"] for s in self.shards) + self.open_docs

    def journal(self) -> dict:
        return {"version": FORMAT_VERSION, "fingerprint": self.fingerprint,
                "next_file": self.next_file, "shards": self.shards,
                "open": {"num_tokens": self.open_tokens, "num_docs": self.open_docs}}

    def _finalize_pending(self) -> None:
        """Idempotent: temp files of a committed closed shard -> docs .npy, final tokens name."""
        for i in self._pending:
            tok_tmp, doc_tmp = self._tok_tmp(i), self._doc_tmp(i)
            if tok_tmp.exists():
                starts = np.fromfile(doc_tmp, dtype="<i8")
                npy_tmp = self.out / (docs_name(i) + ".tmp")
                with open(npy_tmp, "wb") as f:
                    np.save(f, starts)
                os.replace(npy_tmp, self.out / docs_name(i))
                os.replace(tok_tmp, self.out / tokens_name(i))
            doc_tmp.unlink(missing_ok=True)
            if not (self.out / tokens_name(i)).exists():
                raise OSError(f"shard {tokens_name(i)} is missing from {self.out}; "
                              "re-run with --overwrite")
        self._pending = []

    def seal(self) -> None:
        """Close the open shard (a writer without its own journal, before the owner's last
        commit records it)."""
        if self.open_tokens > 0:
            self._close_shard()

    def finish(self, next_file: int, extra: dict | None = None) -> list[dict]:
        """Close the last shard, commit, drop empty temp files; returns the closed shards."""
        self.seal()
        self.commit(next_file, extra)
        self.finalize()
        self.abandon()
        self._tok_tmp(self.open_index).unlink(missing_ok=True)
        self._doc_tmp(self.open_index).unlink(missing_ok=True)
        return self.shards

    def abandon(self) -> None:
        """Close the file handles (without a commit when called after an error)."""
        self._tok_f.close()
        self._doc_f.close()

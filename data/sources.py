"""Input files -> documents -> token arrays: input discovery and the per-file preparation worker.

`resolve_inputs` turns the command-line inputs into a sorted, de-duplicated list of files (the order
that fixes the output); `tokenize_file` turns one file into its tokens, every document followed by
`eos_id`. Errors about the inputs are `InputError`s with a one-line message naming the fix.

Deliberately not here: writing shards (see `data.shards`) and any splitting of one file across
workers: a file is the unit of work and of resumption, so one huge file is tokenised by one process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.tokenizer import ByteTokenizer, Tokenizer

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")  # whole file = one document
SUPPORTED_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
ENCODE_BATCH_DOCS = 1024  # documents tokenised per encode_batch call (bounds memory)


class InputError(ValueError):
    """Bad input (missing path, unsupported file, malformed record); the message is one line."""


@dataclass(frozen=True)
class Source:
    path: Path
    size_bytes: int
    mtime_ns: int

    def to_json(self) -> dict:
        return {"path": str(self.path), "bytes": self.size_bytes, "mtime_ns": self.mtime_ns}


def _source(p: Path) -> Source:
    st = p.stat()
    return Source(p, st.st_size, st.st_mtime_ns)


def resolve_inputs(inputs: Sequence[str | Path]) -> list[Source]:
    """Files and folders (recursive; hidden entries skipped) -> supported files in sorted order."""
    if not inputs:
        raise InputError("no inputs given; pass files or folders to prepare")
    found: dict[Path, Source] = {}
    for given in inputs:
        p = Path(given).absolute()
        if not p.exists():
            raise InputError(f"input {str(given)!r} does not exist; check the path")
        if p.is_file():
            if p.suffix not in SUPPORTED_SUFFIXES:
                raise InputError(f"input {str(given)!r} has unsupported type {p.suffix!r}; "
                                 f"use one of {' '.join(SUPPORTED_SUFFIXES)}")
            found[p] = _source(p)
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for f in files:
                if not f.startswith(".") and Path(f).suffix in SUPPORTED_SUFFIXES:
                    q = Path(root) / f
                    found[q] = _source(q)
    if not found:
        raise InputError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files under {list(map(str, inputs))}; "
                         "pass folders that hold supported files")
    return [found[k] for k in sorted(found, key=str)]


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg}); "
                                     "fix or remove the line") from None
                if not isinstance(rec, dict) or field not in rec:
                    raise InputError(f"{path}:{lineno}: no field {field!r}; "
                                     "pass --text-field with the field that holds the text")
                text = rec[field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise InputError(f"{path}:{lineno}: field {field!r} is "
                                     f"{type(text).__name__}, not a string; pass --text-field")
                yield text
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not UTF-8 ({e.reason}); re-encode the file") from None


def _parquet_texts(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: cannot read parquet ({str(e).splitlines()[0]}); "
                         "check the file") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise InputError(f"{path}: no column {field!r} (columns: {names}); "
                         "pass --text-field with the column that holds the text")
    ftype = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
        raise InputError(f"{path}: column {field!r} is {ftype}, not a string; pass --text-field")
    for batch in pf.iter_batches(batch_size=ENCODE_BATCH_DOCS, columns=[field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one file, in file order (empty ones included; the caller skips them)."""
    if path.suffix in TEXT_SUFFIXES:
        # Invalid UTF-8 becomes U+FFFD rather than failing a whole corpus on one odd file.
        yield path.read_bytes().decode("utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        yield from _jsonl_texts(path, text_field)
    elif path.suffix == ".parquet":
        yield from _parquet_texts(path, text_field)
    else:
        raise InputError(f"{path}: unsupported type {path.suffix!r}")


def _batched(it: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_texts(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """Token arrays of the non-empty texts, each followed by eos."""
    if isinstance(tok, ByteTokenizer):  # fast path: the bytes are the ids
        ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        ids = [np.asarray(x, dtype=np.int64) for x in tok.encode_batch(texts)]
    eos = np.array([tok.eos_id], dtype=dtype)
    return [np.concatenate([x.astype(dtype), eos]) for x in ids if x.size]


# Worker-process state, set once per process by `init_worker` (also used in-process for 1 worker).
_WORKER: dict = {}


def init_worker(tok: Tokenizer, dtype: str, text_field: str, quiet_threads: bool) -> None:
    if quiet_threads:  # N processes each running a Rust thread pool would oversubscribe the CPUs
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=tok, dtype=np.dtype(dtype), text_field=text_field)


def tokenize_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One file -> (tokens [n_tokens] in the shard dtype, doc_lens [n_docs] int64, eos included)."""
    tok, dtype, field = _WORKER["tok"], _WORKER["dtype"], _WORKER["text_field"]
    docs: list[np.ndarray] = []
    for texts in _batched(read_documents(path, field), ENCODE_BATCH_DOCS):
        docs.extend(tokenize_texts(tok, texts, dtype))
    if not docs:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    doc_lens = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
    return np.concatenate(docs), doc_lens

"""Tokenise text files into packed token shards: `python -m data.prepare INPUT... --output DIR`.

Inputs are files or folders (.txt .md .py .rst: one document per file; .jsonl: one per line;
.parquet: one per row), taken in sorted path order so the output does not depend on --workers.
Files are tokenised by a process pool, written in order, and committed to a journal at file
boundaries (after a finished file, at most every COMMIT_INTERVAL_S): an interrupted run, re-run
with the same arguments, resumes after the last committed file and ends byte-identical to an
uninterrupted run. The format is described in `data.shards`.

Refuses (exit 2, touching nothing) to write into a folder holding a finished corpus, another
preparation's files or anything else, unless --overwrite. Bad inputs give a one-line error, exit 2
and leave no output behind.

Validation split (`--val-fraction F`): every document whose running index i has
floor((i + 1) F) > floor(i F) (evenly spaced, exactly floor(N F) of N) goes to `<output>/val/`,
a prepared folder of its own, instead of the training shards; whole documents, so the two are
disjoint. Both writers commit in the one journal, so a resumed run splits the same way.

Deliberately not here: deduplication, filtering, shuffling (the loader shuffles), BOS insertion.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from data.shards import (
    FORMAT_VERSION,
    JOURNAL,
    MANIFEST,
    ShardWriter,
    docs_name,
    is_ours,
    read_json,
    token_dtype,
    tokens_name,
    write_json_atomic,
)
from data.sources import InputError, Source, init_worker, resolve_inputs, tokenize_file
from data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 27  # 134M tokens: 256 MiB per shard at uint16
# The journal is committed after a finished file, but at most this often: an atomic rename costs
# ~1 ms on ext4, which would dominate a corpus of many small files. A crash loses <= this much work.
COMMIT_INTERVAL_S = 0.25


class PrepareError(ValueError):
    """The output folder cannot be written as asked; the message is one line naming the fix."""


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _check_output(out: Path, fingerprint: str, overwrite: bool) -> dict | None:
    """Journal to resume from, or None for a fresh start; raises PrepareError to refuse."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise PrepareError(f"--output {out} exists and is not a folder; choose another path")
    if overwrite:
        _remove_ours(out, created=False)
        return None
    manifest = read_json(out / MANIFEST)
    if manifest is not None or (out / MANIFEST).exists():
        what = "a finished corpus" if manifest and manifest.get("complete") else "a manifest"
        raise PrepareError(f"{out} already holds {what}; pass --overwrite to replace it")
    journal = read_json(out / JOURNAL)
    if journal is not None:
        if journal.get("version") == FORMAT_VERSION and journal.get("fingerprint") == fingerprint:
            return journal
        raise PrepareError(f"{out} holds an unfinished preparation with a different tokenizer, "
                           "inputs or settings; re-run it with its own arguments to resume, "
                           "or pass --overwrite to discard it")
    if any(out.iterdir()):
        raise PrepareError(f"{out} is not empty; pass --overwrite or choose an empty folder")
    return None


VAL_DIR = "val"


def is_val(index: np.ndarray, fraction: float) -> np.ndarray:
    """[n] bool: which documents (running indices `index`) the validation split takes."""
    return np.floor((index + 1) * fraction) > np.floor(index * fraction)


def _split(tokens: np.ndarray, doc_lens: np.ndarray, first: int, fraction: float
           ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """One file's documents -> (train, val) (tokens, doc_lens); `first`: its first doc's index."""
    val = is_val(np.arange(first, first + doc_lens.size, dtype=np.int64), fraction)  # [n_docs]
    per_token = np.repeat(val, doc_lens)  # [n_tokens]
    return ((tokens[~per_token], doc_lens[~val]), (tokens[per_token], doc_lens[val]))


def _tokenized(todo: list[Source], tok: Tokenizer, dtype: np.dtype, text_field: str,
               workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, doc_lens) for each file of `todo`, in order."""
    paths = [s.path for s in todo]
    workers = min(workers, len(paths))
    if workers <= 1:
        init_worker(tok, dtype.str, text_field, quiet_threads=False)
        yield from map(tokenize_file, paths)
        return
    # spawn, not fork: the parent may hold torch / tokenizers thread pools that fork would break.
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=init_worker,
                  initargs=(tok, dtype.str, text_field, True)) as pool:
        yield from pool.imap(tokenize_file, paths, chunksize=1)


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(),
                    TextColumn("{task.fields[files]}"), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not (enabled and sys.stderr.isatty()))


def _remove_ours(out: Path, created: bool) -> None:
    val = out / VAL_DIR
    if val.is_dir():
        _remove_ours(val, created=True)
    for f in out.iterdir():
        if f.is_file() and is_ours(f.name):
            f.unlink()
    if created and not any(out.iterdir()):
        out.rmdir()


def prepare(inputs: Sequence[str | Path], output: str | Path, tokenizer: str | Tokenizer = "byte",
            workers: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            text_field: str = "text", overwrite: bool = False, progress: bool = True,
            val_fraction: float = 0.0) -> Path:
    """Tokenise `inputs` into shards under `output` (and a validation split of whole documents
    under `output/val` if `val_fraction` > 0); returns the output folder.

    Raises InputError (bad inputs or tokenizer) or PrepareError (output folder refused).
    """
    if shard_tokens < 1:
        raise PrepareError(f"shard_tokens={shard_tokens} must be positive; use e.g. {1 << 27}")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction} must be in [0, 1), e.g. 0.01")
    if isinstance(tokenizer, str | Path):
        try:
            tok = load_tokenizer(tokenizer)
        except ValueError as e:
            raise InputError(str(e)) from None
    else:
        tok = tokenizer
    sources = resolve_inputs(inputs)
    out = Path(output).absolute()
    dtype = token_dtype(tok.vocab_size)
    fingerprint = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": dtype.name,
                   "eos_id": tok.eos_id, "shard_tokens": shard_tokens, "text_field": text_field,
                   "sources": [s.to_json() for s in sources],
                   **({"val_fraction": val_fraction} if val_fraction else {})}
    # The journal, rewritten at every commit, holds only a digest of this (sources can be many).
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    journal = _check_output(out, digest, overwrite)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)

    writer = ShardWriter(out, dtype, shard_tokens, digest, journal)
    val = None
    if val_fraction:
        (out / VAL_DIR).mkdir(exist_ok=True)
        val = ShardWriter(out / VAL_DIR, dtype, shard_tokens, digest,
                          (journal or {}).get("val"), own_journal=False)

    def commit(next_file: int) -> None:  # the validation writer's state rides in the journal
        if val is not None:
            val.commit(next_file)
        writer.commit(next_file, {"val": val.journal()} if val is not None else None)
        if val is not None:
            val.finalize()

    todo = sources[writer.next_file:]
    try:
        if workers is None:  # byte "tokenisation" is a copy: a pool only adds pickling
            workers = 1 if isinstance(tok, ByteTokenizer) else default_workers()
        pool_results = _tokenized(todo, tok, dtype, text_field, workers)
        with _progress(progress) as bar, closing(pool_results) as results:  # closing ends the pool
            task = bar.add_task("prepare", total=sum(s.size_bytes for s in todo),
                                files=f"0/{len(todo)} files")
            first, last_commit = writer.next_file, time.monotonic()
            for i, (tokens, doc_lens) in enumerate(results):
                if val is None:
                    writer.add(tokens, doc_lens)
                else:
                    train_part, val_part = _split(tokens, doc_lens,
                                                  writer.num_docs + val.num_docs, val_fraction)
                    writer.add(*train_part)
                    val.add(*val_part)
                if time.monotonic() - last_commit >= COMMIT_INTERVAL_S:
                    commit(first + i + 1)
                    last_commit = time.monotonic()
                bar.update(task, advance=todo[i].size_bytes, files=f"{i + 1}/{len(todo)} files")
        if val is not None:
            val.seal()
        shards = writer.finish(len(sources), {"val": val.journal()} if val is not None
                               else None)
        val_shards = val.finish(len(sources)) if val is not None else []
        if not shards:
            raise InputError(f"inputs {list(map(str, inputs))} hold no non-empty documents "
                             "for training; check --text-field and the files"
                             + (", or lower --val-fraction" if val else ""))
        if val is not None and not val_shards:
            n = writer.num_docs
            raise InputError(f"--val-fraction {val_fraction} holds out no document of {n}; "
                             f"raise it to at least {1 / n:.3g} or prepare more documents")
    except InputError:
        for w in (writer, val):
            if w is not None:
                w.abandon()
        _remove_ours(out, created)
        raise
    except BaseException:
        for w in (writer, val):  # the journal stays: re-running the same command resumes
            if w is not None:
                w.abandon()
        raise

    def manifest(parts: list[dict], **extra) -> dict:
        return {
            "format": "k3train.tokens", "version": FORMAT_VERSION, "complete": True,
            "tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": dtype.name,
            "eos_id": tok.eos_id, "bos_id": tok.bos_id, "text_field": text_field,
            "shard_tokens": shard_tokens,
            "num_tokens": sum(s["num_tokens"] for s in parts),
            "num_docs": sum(s["num_docs"] for s in parts),
            "shards": [{"tokens": tokens_name(i), "docs": docs_name(i), **s}
                       for i, s in enumerate(parts)],
            **extra,
        }

    if val is not None:  # the validation folder is complete before the corpus is
        write_json_atomic(out / VAL_DIR / MANIFEST, manifest(val_shards, split="val"))
        extra = {"val": {"folder": VAL_DIR, "fraction": val_fraction,
                         "num_docs": sum(s["num_docs"] for s in val_shards),
                         "num_tokens": sum(s["num_tokens"] for s in val_shards)}}
    else:
        extra = {}
    write_json_atomic(out / MANIFEST, manifest(shards, **extra, sources=fingerprint["sources"]))
    (out / JOURNAL).unlink(missing_ok=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders (recursive)")
    ap.add_argument("--output", required=True, metavar="DIR")
    ap.add_argument("--tokenizer", default="byte", help="'byte', a path to tokenizer.json, or "
                    "a folder with tiktoken.model (K3's release)")
    ap.add_argument("--workers", type=int, default=None,
                    help=f"tokenising processes (default: 1 for byte, else {default_workers()})")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    ap.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    ap.add_argument("--overwrite", action="store_true", help="replace what DIR holds")
    ap.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                    help="hold out this fraction of whole documents as DIR/val (e.g. 0.01)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = prepare(args.inputs, args.output, args.tokenizer, workers=args.workers,
                      shard_tokens=args.shard_tokens, text_field=args.text_field,
                      overwrite=args.overwrite, val_fraction=args.val_fraction)
    except (InputError, PrepareError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    m = read_json(out / MANIFEST) or {}
    print(f"prepared {m.get('num_tokens')} tokens in {m.get('num_docs')} documents, "
          f"{len(m.get('shards', []))} shard(s), tokenizer {m.get('tokenizer')} -> {out} "
          f"({time.perf_counter() - t0:.1f} s)")
    if "val" in m:
        v = m["val"]
        print(f"validation split: {v['num_tokens']} tokens in {v['num_docs']} documents -> "
              f"{out / v['folder']} (use eval.every=N to evaluate on it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

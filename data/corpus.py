"""The embedded default corpus: the running Python's standard library source, prepared once.

Every machine that has Python has this text, so demos and tests train on real data with no
download. `default_corpus_dir()` prepares it on first use into a cache folder, under an exclusive
`fcntl.flock` so that several ranks starting together prepare it once (the others wait, then reuse
it); later calls return at once. `VAL_FRACTION` of its files (whole, evenly spaced) are held out
as the validation split (`<folder>/val`).

Deliberately not here: downloads, any corpus other than the stdlib, Windows (fcntl).
"""

from __future__ import annotations

import fcntl
import os
import sys
import sysconfig
from pathlib import Path

from data.prepare import PrepareError, prepare
from data.shards import MANIFEST, read_json
from data.tokenizer import load_tokenizer

DEFAULT_MAX_BYTES = 20_000_000  # ~20 MB of source text; ~20M tokens with the byte tokenizer
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
VAL_FRACTION = 0.02


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """Standard-library *.py files in sorted path order, while their total stays <= max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".")]
        found.extend(Path(d) / f for f in files if f.endswith(".py"))
    taken, total_bytes = [], 0
    for p in sorted(found, key=str):
        size = p.stat().st_size
        if total_bytes + size > max_bytes:
            break
        taken.append(p)
        total_bytes += size
    return taken


def _is_complete(folder: Path) -> bool:
    """Prepared, with its validation split (an older cache without one is prepared again)."""
    m = read_json(folder / MANIFEST)
    return bool(m and m.get("complete") and "val" in m)


def default_corpus_dir(tokenizer_spec: str = "byte", cache_dir: str | Path | None = None,
                       max_bytes: int = DEFAULT_MAX_BYTES, workers: int | None = None) -> Path:
    """Folder of the prepared stdlib corpus, preparing it first if no process has yet.

    The folder is `<cache>/stdlib-py3.11-<tokenizer name>` (plus `-<max_bytes>b` for a non-default
    cap), where <cache> is `cache_dir`, else $K3TRAIN_CACHE, else ~/.cache/k3train.
    """
    tok = load_tokenizer(tokenizer_spec)
    base = Path(cache_dir or os.environ.get("K3TRAIN_CACHE") or Path.home() / ".cache/k3train")
    name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{tok.name}"
    name = name.replace(":", "-") + ("" if max_bytes == DEFAULT_MAX_BYTES else f"-{max_bytes}b")
    out = base / name
    if _is_complete(out):
        return out
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we crash
        if _is_complete(out):  # another process prepared it while we waited
            return out
        files = stdlib_files(max_bytes)
        print(f"k3train: preparing the default corpus ({len(files)} stdlib files) into {out}",
              file=sys.stderr)
        # at least one file held out, also for a small max_bytes
        fraction = min(0.5, max(VAL_FRACTION, 1 / max(1, len(files))))
        try:  # resumes an interrupted preparation with the same inputs
            prepare(files, out, tok, workers=workers, val_fraction=fraction)
        except PrepareError:  # leftovers of a different preparation (e.g. another stdlib)
            prepare(files, out, tok, workers=workers, overwrite=True, val_fraction=fraction)
    return out

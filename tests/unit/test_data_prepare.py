"""data.prepare: round trip, manifest, determinism over workers, resume, refusals, bad inputs;
data.corpus: the default corpus is prepared once and reused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.corpus
import data.prepare
from data.prepare import prepare
from data.shards import ShardWriter
from data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT_FILES = {
    "a.txt": "Hello, world.\nSecond line with ünïcödé and 日本語.\n",
    "b.md": "# Title\n\nSome *markdown* text, with a literal <|endoftext|> inside.\n",
    "sub/c.py": "def f(x):\n    return x * 2\n",
    "sub/deeper/d.rst": "Section\n=======\n\nreStructuredText body.\n",
    "sub/empty.txt": "",
}
JSONL = ["first json doc", "", "second json doc\nwith two lines", "third 🚀"]
PARQUET = ["parquet row one", None, "parquet row two, longer than the others by a bit", ""]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """A folder of every supported type; returns it and its non-empty documents in order."""
    root = tmp_path / "src"
    docs_by_file: dict[str, list[str]] = {}
    for name, text in TEXT_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
        docs_by_file[str(root / name)] = [text]
    with open(root / "e.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(JSONL):
            f.write(json.dumps({"id": i, "text": t}) + "\n" + ("\n" if i == 1 else ""))
    docs_by_file[str(root / "e.jsonl")] = JSONL
    pq.write_table(pa.table({"text": PARQUET, "n": list(range(len(PARQUET)))}),
                   root / "f.parquet")
    docs_by_file[str(root / "f.parquet")] = PARQUET
    (root / "notes.csv").write_text("ignored,in,folders\n")
    expected = [d for k in sorted(docs_by_file) for d in docs_by_file[k] if d]
    return root, expected


@pytest.fixture
def hf_tokenizer(corpus, tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus[1], trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def read_docs(out: Path) -> tuple[dict, list[np.ndarray]]:
    """The manifest and every document's tokens (eos included), from the files alone."""
    m = json.loads((out / "manifest.json").read_text())
    docs = []
    for s in m["shards"]:
        toks = np.fromfile(out / s["tokens"], dtype=m["dtype"])
        starts = np.load(out / s["docs"])
        assert toks.size == s["num_tokens"] and starts.size == s["num_docs"] and starts[0] == 0
        docs.extend(np.split(toks, starts[1:]))
    return m, docs


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_round_trip_eos_and_manifest(corpus, hf_tokenizer, tmp_path, kind):
    src, expected = corpus
    tok = ByteTokenizer() if kind == "byte" else HFTokenizer(hf_tokenizer)
    out = prepare([src], tmp_path / "out", str(hf_tokenizer) if kind == "hf" else "byte",
                  workers=1, shard_tokens=40)
    m, docs = read_docs(out)
    assert [tok.decode(d[:-1].tolist()) for d in docs] == expected
    assert all(d[-1] == tok.eos_id and (d[:-1] != tok.eos_id).all() for d in docs)
    for s in m["shards"]:  # documents never straddle: a shard overflows only with one document
        assert s["num_tokens"] <= 40 or s["num_docs"] == 1
    assert len(m["shards"]) > 2
    assert m["complete"] is True and m["tokenizer"] == tok.name and m["eos_id"] == tok.eos_id
    assert m["vocab_size"] == tok.vocab_size and m["dtype"] == "uint16"
    assert m["num_docs"] == len(expected) and m["num_tokens"] == sum(d.size for d in docs)
    files = sorted(str(p) for p in src.rglob("*") if p.suffix != ".csv" and p.is_file())
    assert [s["path"] for s in m["sources"]] == files
    assert all(s["bytes"] == Path(s["path"]).stat().st_size for s in m["sources"])
    assert all(s["mtime_ns"] == Path(s["path"]).stat().st_mtime_ns for s in m["sources"])
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(("tokens-", "docs-"))) \
        == ["manifest.json"]  # no journal or temp files left
    if kind == "hf":
        assert tok.name.startswith("hf:") and len(tok.name) == 15


def test_workers_give_identical_bytes(corpus, hf_tokenizer, tmp_path):
    src, _ = corpus
    a = prepare([src], tmp_path / "w1", str(hf_tokenizer), workers=1, shard_tokens=40)
    b = prepare([src], tmp_path / "w2", str(hf_tokenizer), workers=2, shard_tokens=40)
    assert snapshot(a) == snapshot(b)


def _crash_on_call(monkeypatch, name: str, n: int) -> None:
    monkeypatch.setattr(data.prepare, "COMMIT_INTERVAL_S", 0.0)  # commit after every file
    original = getattr(ShardWriter, name)
    calls = {"n": 0}

    def crashing(self, *args):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt  # as if killed between two steps of the writer
        return original(self, *args)

    monkeypatch.setattr(ShardWriter, name, crashing)


@pytest.mark.parametrize("where,n", [("commit", 1), ("commit", 4), ("commit", 7),
                                     ("_finalize_pending", 3), ("_finalize_pending", 6)])
def test_resume_after_interruption_is_byte_identical(corpus, tmp_path, monkeypatch, where, n):
    src, _ = corpus
    ref = prepare([src], tmp_path / "ref", "byte", workers=1, shard_tokens=40)
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        _crash_on_call(mp, where, n)
        with pytest.raises(KeyboardInterrupt):
            prepare([src], out, "byte", workers=1, shard_tokens=40)
    assert not (out / "manifest.json").exists() and (out / ".progress.json").exists()
    for f in out.glob("tokens-*.bin"):  # anything under a final name is a whole shard
        assert f.read_bytes() == (ref / f.name).read_bytes()
    workers = 2 if (where, n) == ("commit", 4) else 1  # the pool size may change on resume
    prepare([src], out, "byte", workers=workers, shard_tokens=40)
    assert snapshot(out) == snapshot(ref)


def run_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data.prepare", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_cli_refuses_to_overwrite(corpus, tmp_path):
    src, _ = corpus
    out = tmp_path / "out"
    assert run_cli(src, "--output", out, "--workers", "1").returncode == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    assert_one_line_error(run_cli(src, "--output", out), "--overwrite")
    assert_one_line_error(run_cli(src / "a.txt", "--output", out), "--overwrite")
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    r = run_cli(src / "a.txt", "--output", out, "--overwrite", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "manifest.json").read_text())["num_docs"] == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert_one_line_error(run_cli(src, "--output", other), "--overwrite")
    assert [p.name for p in other.iterdir()] == ["keep.txt"]


def test_unfinished_run_with_other_inputs_is_refused(corpus, tmp_path, monkeypatch):
    src, _ = corpus
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        _crash_on_call(mp, "commit", 2)
        with pytest.raises(KeyboardInterrupt):
            prepare([src], out, "byte", workers=1)
    before = snapshot(out)
    assert_one_line_error(run_cli(src / "a.txt", "--output", out), "--overwrite", "resume")
    assert snapshot(out) == before


@pytest.mark.parametrize("case", ["missing", "unsupported", "no_field", "bad_json",
                                  "tokenizer_path", "tokenizer_file"])
def test_cli_bad_inputs_one_line_exit_2(corpus, tmp_path, case):
    src, _ = corpus
    out = tmp_path / "out"
    bad = tmp_path / "bad"
    bad.mkdir()
    args: list = [src]
    if case == "missing":
        args, words = [tmp_path / "nope.txt"], ["does not exist"]
    elif case == "unsupported":
        args, words = [src / "notes.csv"], ["unsupported", ".csv"]
    elif case == "no_field":
        (bad / "z.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
        args, words = [src, bad], ["z.jsonl:2", "--text-field"]
    elif case == "bad_json":
        (bad / "z.jsonl").write_text('{"text": "ok"}\n{"text": \n')
        args, words = [src, bad], ["z.jsonl:2", "JSON"]
    elif case == "tokenizer_path":
        args, words = [src, "--tokenizer", tmp_path / "missing.json"], ["--tokenizer byte"]
    else:
        (bad / "tokenizer.json").write_text("{not json")
        args, words = [src, "--tokenizer", bad / "tokenizer.json"], ["tokenizer.json"]
    workers = "2" if case == "no_field" else "1"  # an error raised inside a worker process
    assert_one_line_error(run_cli(*args, "--output", out, "--workers", workers), *words)
    assert not out.exists()


def test_load_tokenizer_specs(hf_tokenizer, tmp_path):
    b = load_tokenizer("byte")
    assert (b.vocab_size, b.bos_id, b.eos_id, b.name) == (259, 256, 257, "byte")
    assert b.decode(b.encode("héllo") + [b.eos_id]) == "héllo<|eos|>"
    h = load_tokenizer(hf_tokenizer.parent)  # a folder holding tokenizer.json works too
    assert h.eos_id == h.bos_id == 0 and h.vocab_size <= 320
    assert h.encode_batch(["ab", "c"]) == [h.encode("ab"), h.encode("c")]
    with pytest.raises(ValueError, match="byte"):
        load_tokenizer(tmp_path / "nothing")


def test_default_corpus_prepared_once_then_reused(tmp_path, monkeypatch):
    out = data.corpus.default_corpus_dir(cache_dir=tmp_path, max_bytes=200_000, workers=1)
    m, docs = read_docs(out)
    assert m["complete"] and 0 < sum(s["bytes"] for s in m["sources"]) <= 200_000
    assert all("site-packages" not in s["path"] for s in m["sources"])
    # bytes + eos (>: invalid UTF-8 in an odd stdlib file becomes 3-byte U+FFFD)
    v = m["val"]  # whole files held out for validation
    assert v["num_docs"] >= 1
    assert (m["num_tokens"] + v["num_tokens"]
            >= sum(s["bytes"] for s in m["sources"]) + m["num_docs"] + v["num_docs"])
    stamp = (out / "manifest.json").stat().st_mtime_ns

    def must_not_run(*a, **k):
        raise AssertionError("the default corpus was prepared twice")

    monkeypatch.setattr(data.corpus, "prepare", must_not_run)
    assert data.corpus.default_corpus_dir(cache_dir=tmp_path, max_bytes=200_000) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp


def test_default_corpus_concurrent_ranks_prepare_once(tmp_path):
    code = ("import data.corpus as c; print(c.default_corpus_dir("
            f"cache_dir={str(tmp_path)!r}, max_bytes=150_000, workers=1))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert len({out for out, _ in results}) == 1
    assert sum("preparing the default corpus" in err for _, err in results) == 1

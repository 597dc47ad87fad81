"""K3's tokenizer format (`data.tokenizer.TiktokenTokenizer`): a tiktoken BPE model made here
(every byte plus a few merges) with a Kimi-style `tokenizer_config.json`: ids, special tokens,
special names inside documents kept as text, pickling for workers, `python -m data.prepare
--tokenizer <dir>`, and one-line errors for files that are not one."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.tokenizer import TiktokenTokenizer, load_tokenizer
from tests.helpers.runs import ROOT

MERGES = [b"th", b"he", b"the", b" the", b"in", b"ing", b" \xe4\xbd", "你好".encode()]
BASE = 256 + len(MERGES)


@pytest.fixture
def k3_tokenizer(tmp_path: Path) -> Path:
    folder = tmp_path / "k3tok"
    folder.mkdir()
    tokens = [bytes([b]) for b in range(256)] + MERGES
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    specials = {BASE: "[BOS]", BASE + 1: "[EOS]", BASE + 3: "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": c, "special": True}
                                 for i, c in specials.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "tokenizer_class": "TikTokenTokenizer"}))
    return folder


def test_ids_specials_and_round_trip(k3_tokenizer):
    tok = load_tokenizer(k3_tokenizer)
    assert isinstance(tok, TiktokenTokenizer) and tok.name.startswith("tiktoken:")
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (BASE, BASE + 1, BASE + 256)
    assert tok.special["<|im_end|>"] == BASE + 3
    assert tok.special[f"<|reserved_token_{BASE + 2}|>"] == BASE + 2
    rank = {t: 256 + i for i, t in enumerate(MERGES)}
    assert tok.encode("the") == [rank[b"the"]]
    assert tok.encode(" the") == [rank[b" the"]]
    assert tok.encode("thing") == [rank[b"th"], rank[b"ing"]]
    assert tok.encode("你好") == [rank["你好".encode()]]
    for text in ("the theme is 12345 in 你好世界!\n\n  tabs\tand spaces", "Ünïcödé ... ok"):
        assert tok.decode(tok.encode(text)) == text
    # a special token's name inside a document is ordinary text, never the boundary id
    ids = tok.encode("a [EOS] b")
    assert tok.eos_id not in ids and tok.decode(ids) == "a [EOS] b"
    assert tok.encode_batch(["the", "in"]) == [[rank[b"the"]], [rank[b"in"]]]
    assert load_tokenizer(k3_tokenizer / "tiktoken.model").name == tok.name


def test_pickles_for_worker_processes(k3_tokenizer):
    tok = load_tokenizer(k3_tokenizer)
    back = pickle.loads(pickle.dumps(tok))
    assert back.name == tok.name and back.encode("the thing") == tok.encode("the thing")
    assert (back.eos_id, back.vocab_size) == (tok.eos_id, tok.vocab_size)


def test_prepare_cli_with_the_k3_tokenizer(k3_tokenizer, tmp_path):
    docs = tmp_path / "docs.jsonl"
    texts = ["the thing in 你好", "another the document", "third"]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "prepared"
    r = subprocess.run([sys.executable, "-m", "data.prepare", str(docs), "--output", str(out),
                        "--tokenizer", str(k3_tokenizer), "--workers", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    tok = load_tokenizer(k3_tokenizer)
    assert manifest["tokenizer"] == tok.name and manifest["eos_id"] == tok.eos_id
    ids = np.concatenate([np.fromfile(f, dtype=manifest["dtype"])
                          for f in sorted(out.glob("tokens-*.bin"))]).tolist()
    want = [i for t in texts for i in [*tok.encode(t), tok.eos_id]]
    assert sorted(ids) == sorted(want) and ids.count(tok.eos_id) == 3


@pytest.mark.parametrize("case", ["bad_line", "empty", "no_eos"])
def test_a_broken_tiktoken_folder_is_a_one_line_error(k3_tokenizer, case):
    model, config = k3_tokenizer / "tiktoken.model", k3_tokenizer / "tokenizer_config.json"
    if case == "bad_line":
        model.write_text(model.read_text() + "not-base64!! x\n")
    elif case == "empty":
        model.write_text("")
    else:
        config.write_text(json.dumps({"added_tokens_decoder": {}}))
    with pytest.raises(ValueError) as e:
        load_tokenizer(k3_tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and str(k3_tokenizer) in msg
    assert {"bad_line": "line 265", "empty": "no tokens", "no_eos": "eos_token="}[case] in msg

"""Tokenizers behind one small interface: a byte-level one for tests/demos, a Hugging Face
`tokenizer.json`, and a tiktoken BPE model (Kimi K2's and K3's: `tiktoken.model` with the special
tokens of its `tokenizer_config.json`).

All expose `name` (a stable id written into manifests and cache keys), `encode`, `encode_batch`,
`decode`, `bos_id`, `eos_id` and `vocab_size`. Text is encoded without any special tokens: the
preparer appends `eos_id` after each document itself, and a literal "<|endoftext|>" inside a
document is encoded as ordinary text, never as a boundary.

Deliberately not here: chat templates, padding/truncation, training tokenizers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _HFCore

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|im_end|>", "<|end_of_text|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|im_start|>")


class Tokenizer(Protocol):
    name: str
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; bos=256, eos=257, pad=258; vocab_size 259."""

    name = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    _SPECIAL_TEXT = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Bytes decode as UTF-8 (invalid runs become U+FFFD); specials render as <|eos|> etc."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self._SPECIAL_TEXT.get(i, f"<|{i}|>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; name is "hf:" + the first 12 hex digits of its sha256."""

    def __init__(self, path: str | Path, eos_token: str | None = None,
                 bos_token: str | None = None) -> None:
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
            core = _HFCore.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"cannot load tokenizer {str(path)!r} ({msg}); pass a Hugging Face "
                             "tokenizer.json or 'byte'") from None
        self.name = "hf:" + hashlib.sha256(raw).hexdigest()[:12]
        self._json = raw.decode("utf-8")
        self._setup(core, eos_token, bos_token)

    def _setup(self, core: _HFCore, eos_token: str | None, bos_token: str | None) -> None:
        core.encode_special_tokens = True  # special-token strings inside documents stay text
        self._core = core
        self._eos_token, self._bos_token = eos_token, bos_token
        eos = self._find(eos_token, EOS_NAMES)
        if eos is None:
            raise ValueError(f"tokenizer {str(self.path)!r} has none of the eos tokens "
                             f"{list(EOS_NAMES)}; pass eos_token='<its end-of-text token>'")
        bos = self._find(bos_token, BOS_NAMES)
        self.eos_id = eos
        self.bos_id = eos if bos is None else bos  # GPT-2 convention: one token for both
        self.vocab_size = core.get_vocab_size(with_added_tokens=True)

    def _find(self, explicit: str | None, names: tuple[str, ...]) -> int | None:
        if explicit is not None:
            i = self._core.token_to_id(explicit)
            if i is None:
                raise ValueError(f"token {explicit!r} is not in tokenizer {str(self.path)!r}; "
                                 "pass a token that the tokenizer defines")
            return i
        for n in names:
            i = self._core.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._core.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._core.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._core.decode([int(i) for i in ids], skip_special_tokens=False)

    # Pickling (for worker processes) goes through the JSON text: the tokenizers core object
    # forgets `encode_special_tokens` when pickled.
    def __getstate__(self) -> dict:
        return {"path": str(self.path), "name": self.name, "json": self._json,
                "eos_token": self._eos_token, "bos_token": self._bos_token}

    def __setstate__(self, s: dict) -> None:
        self.path, self.name, self._json = Path(s["path"]), s["name"], s["json"]
        self._setup(_HFCore.from_str(s["json"]), s["eos_token"], s["bos_token"])

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, name={self.name!r})"


# Kimi's pre-tokenisation (K2/K3 `tokenization_kimi.py`): Han runs, cased words with English
# contractions, 1-3 digits, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
TIKTOKEN_FILE = "tiktoken.model"
RESERVED_SPECIAL = 256  # ids base..base+255 are special; unnamed ones are <|reserved_token_i|>


class TiktokenTokenizer:
    """A tiktoken BPE model (`<dir>/tiktoken.model`: base64 token, rank per line) with Kimi's
    special tokens: the ids after the base vocabulary, named by `tokenizer_config.json`'s
    `added_tokens_decoder` (`bos_token`, `eos_token` pick BOS and EOS; else the usual names);
    name is "tiktoken:" + the first 12 hex digits of the sha256 of both files."""

    def __init__(self, folder: str | Path, eos_token: str | None = None) -> None:
        self.path = Path(folder)
        model, config = self.path / TIKTOKEN_FILE, self.path / "tokenizer_config.json"
        try:
            raw = model.read_bytes()
            cfg_raw = config.read_bytes() if config.is_file() else b"{}"
            cfg = json.loads(cfg_raw)
            ranks = _tiktoken_ranks(raw)
        except (OSError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"cannot load tiktoken tokenizer {str(folder)!r} ({msg}); pass a "
                             f"folder with {TIKTOKEN_FILE} (base64 token and rank per line) "
                             "and tokenizer_config.json") from None
        self.name = "tiktoken:" + hashlib.sha256(raw + b"\0" + cfg_raw).hexdigest()[:12]
        self._state = {"ranks": ranks, "cfg": cfg, "eos_token": eos_token}
        self._setup()

    def _setup(self) -> None:
        import tiktoken

        ranks, cfg = self._state["ranks"], self._state["cfg"]
        base = len(ranks)
        named = {int(i): t["content"] if isinstance(t, dict) else str(t)
                 for i, t in cfg.get("added_tokens_decoder", {}).items() if int(i) >= base}
        ids = range(base, max([base + RESERVED_SPECIAL - 1, *named]) + 1)
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
        self._enc = tiktoken.Encoding(name=self.name, pat_str=KIMI_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self.special)
        self.vocab_size = self._enc.n_vocab
        eos = self._special(self._state["eos_token"] or _token_text(cfg.get("eos_token")),
                            EOS_NAMES, "eos")
        bos = self._special(_token_text(cfg.get("bos_token")), BOS_NAMES, None)
        self.eos_id = eos
        self.bos_id = eos if bos is None else bos

    def _special(self, explicit: str | None, names: tuple[str, ...], what: str | None):
        if explicit is not None:
            if explicit not in self.special:
                raise ValueError(f"token {explicit!r} is not a special token of tokenizer "
                                 f"{str(self.path)!r}; pass one its tokenizer_config.json names")
            return self.special[explicit]
        found = next((self.special[n] for n in names if n in self.special), None)
        if found is None and what:
            raise ValueError(f"tokenizer {str(self.path)!r} has none of the {what} tokens "
                             f"{list(names)}; pass eos_token='<its end-of-text token>'")
        return found

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())  # special names stay text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch(texts, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:  # the tiktoken core does not pickle
        return {"path": str(self.path), "name": self.name, **self._state}

    def __setstate__(self, s: dict) -> None:
        self.path, self.name = Path(s.pop("path")), s.pop("name")
        self._state = s
        self._setup()

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({str(self.path)!r}, name={self.name!r})"


def _tiktoken_ranks(raw: bytes) -> dict[bytes, int]:
    """tiktoken's BPE file: one `base64(token) rank` per line (what `load_tiktoken_bpe` reads)."""
    ranks = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"line {n} is not '<base64 token> <rank>'") from None
    if not ranks:
        raise ValueError("no tokens")
    return ranks


def _token_text(tok) -> str | None:
    """A tokenizer_config.json token entry: a string or {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


def tokenizer_path(spec: str | Path) -> Path | None:
    """What a tokenizer spec names: a folder holding tiktoken.model, a tokenizer file (a
    folder's tokenizer.json), or None if neither exists."""
    p = Path(spec)
    if p.is_file() and p.name == TIKTOKEN_FILE:
        return p.parent
    if p.is_dir() and (p / TIKTOKEN_FILE).is_file():
        return p
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return p / "tokenizer.json"
    return p if p.is_file() else None


def load_tokenizer(spec: str | Path, eos_token: str | None = None) -> Tokenizer:
    """"byte", a path to a tokenizer.json, or a folder holding one or a tiktoken.model (K3's
    release); ValueError otherwise."""
    if str(spec) == "byte":
        return ByteTokenizer()
    p = tokenizer_path(spec)
    if p is not None and p.is_dir():
        return TiktokenTokenizer(p, eos_token=eos_token)
    if p is None:
        raise ValueError(f"tokenizer {str(spec)!r} is neither 'byte' nor an existing file; "
                         "use --tokenizer byte, a Hugging Face tokenizer.json or a folder with "
                         f"{TIKTOKEN_FILE}")
    try:
        json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tokenizer {str(spec)!r} is not a JSON tokenizer file ({e}); use "
                         "--tokenizer byte or a path to a Hugging Face tokenizer.json") from None
    return HFTokenizer(p, eos_token=eos_token)

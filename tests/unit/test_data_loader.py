"""data.dataset / data.loader: windows and labels against a slow oracle over the token stream,
packing agrees with the document index, and the sample order is a function of (seed, global
position) only: identical over DP sizes, across a resume with another DP size, over epochs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data.dataset import PackedTokenDataset
from data.loader import BatchLoader, epoch_permutation, local_target_tokens
from data.prepare import prepare
from model.packing import Packing

T = 16  # seq_len
EOS = 257  # ByteTokenizer eos


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """~40 samples of T=16 over several shards; documents of 0..20 bytes (empty ones skipped)."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("loader")
    lens = list(rng.integers(0, 20, size=60)) + [1, 0, 1, 1]  # 2-token documents in a row
    lines = ["".join(chr(c) for c in rng.integers(97, 123, size=n)) for n in lens]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return prepare([root / "docs.jsonl"], root / "out", "byte", workers=1, shard_tokens=100)


def oracle_stream(folder: Path) -> tuple[list[int], set[int]]:
    """Token stream and document starts, from the raw shards only (a doc starts after an eos)."""
    m = json.loads((folder / "manifest.json").read_text())
    stream: list[int] = []
    for s in m["shards"]:
        stream += np.fromfile(folder / s["tokens"], dtype=m["dtype"]).tolist()
    starts = {0}
    for pos, tok in enumerate(stream):
        if tok == EOS:
            starts.add(pos + 1)
    return stream, starts


def oracle_sample(stream: list[int], starts: set[int], i: int) -> tuple[list, list, list]:
    inputs, labels, doc_ids, doc = [], [], [], 0
    for j in range(T):
        pos = i * T + j
        if j > 0 and pos in starts:
            doc += 1
        inputs.append(stream[pos])
        labels.append(-100 if pos + 1 in starts else stream[pos + 1])
        doc_ids.append(doc)
    return inputs, labels, doc_ids


def test_windows_labels_and_doc_ids_match_slow_oracle(folder):
    ds = PackedTokenDataset(folder, T)
    stream, starts = oracle_stream(folder)
    assert len(json.loads((folder / "manifest.json").read_text())["shards"]) >= 4
    assert len(ds) == (len(stream) - 1) // T and len(ds) >= 30
    n_ignored = 0
    for i in range(len(ds)):
        s = ds[i]
        inputs, labels, doc_ids = oracle_sample(stream, starts, i)
        assert s["sample_id"] == i
        assert all(s[k].dtype == torch.int64 and s[k].shape == (T,)
                   for k in ("input_ids", "labels", "doc_ids"))
        assert s["input_ids"].tolist() == inputs
        assert s["labels"].tolist() == labels
        assert s["doc_ids"].tolist() == doc_ids
        n_ignored += labels.count(-100)
    assert n_ignored > len(ds)  # boundaries were exercised, several per window on average


def test_dataset_needs_a_complete_manifest(tmp_path):
    with pytest.raises(ValueError, match="python -m data.prepare"):
        PackedTokenDataset(tmp_path, T)


def _flat_starts(batch: dict) -> set[int]:
    """Flat token offsets where a document starts in the next input (label is -100)."""
    ignored = (batch["labels"] == -100).flatten().nonzero().flatten() + 1
    return {int(p) for p in ignored if int(p) % T != 0}


def test_cu_seqlens_agree_with_doc_index(folder):
    ds = PackedTokenDataset(folder, T)
    loader = BatchLoader(ds, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=3)
    for _ in range(3):
        for b in loader.next_step():
            mb = b["input_ids"].shape[0]
            assert b["input_ids"].shape == b["labels"].shape == (mb, T)
            cu = b["cu_seqlens"]
            assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == mb * T
            assert (cu[1:] > cu[:-1]).all()
            doc = torch.stack([ds[int(i)]["doc_ids"] for i in b["sample_ids"]])  # [mb, T]
            expect = {0, mb * T} | {r * T for r in range(mb)}
            expect |= {r * T + j for r in range(mb) for j in range(1, T)
                       if doc[r, j] != doc[r, j - 1]}
            assert set(cu.tolist()) == expect
            assert _flat_starts(b) <= set(cu.tolist())  # every -100 label opens a document
            Packing(mb, T, torch.device("cpu"), cu)  # accepted by the model as is
            assert b["num_target_tokens"] == int((b["labels"] != -100).sum())


def _ids(batches: list[dict]) -> list[int]:
    return torch.cat([b["sample_ids"] for b in batches]).tolist()


def _step_ids(loaders: list[BatchLoader]) -> list[int]:
    """One step of all data ranks, concatenated in rank order."""
    return [i for ld in loaders for i in _ids(ld.next_step())]


def _ranks(ds, dp: int, seed: int = 7, G: int = 8, mb: int = 2) -> list[BatchLoader]:
    return [BatchLoader(ds, G, mb, r, dp, seed) for r in range(dp)]


def test_deterministic_and_seeded(folder):
    ds = PackedTokenDataset(folder, T)
    a, b, c = _ranks(ds, 1)[0], _ranks(ds, 1)[0], _ranks(ds, 1, seed=8)[0]
    steps_a = [a.next_step() for _ in range(3)]
    steps_b = [b.next_step() for _ in range(3)]
    for sa, sb in zip(steps_a, steps_b):
        for x, y in zip(sa, sb):
            assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels", "cu_seqlens"))
    assert [_ids(s) for s in steps_a] != [_ids(c.next_step()) for _ in range(3)]
    assert len(steps_a[0]) == a.grad_accum_steps == 4
    assert local_target_tokens(steps_a[0]) == sum(int((x["labels"] != -100).sum())
                                                  for x in steps_a[0])


def test_epochs_wrap_into_fresh_permutations(folder):
    ds = PackedTokenDataset(folder, T)
    N = len(ds)
    loader = BatchLoader(ds, global_batch=1, micro_batch=1, dp_rank=0, dp_size=1, seed=5)
    seen = [_ids(loader.next_step())[0] for _ in range(2 * N + 3)]
    assert seen[:N] == epoch_permutation(5, 0, N).tolist()
    assert seen[N:2 * N] == epoch_permutation(5, 1, N).tolist()
    assert sorted(seen[N:2 * N]) == list(range(N)) and seen[:N] != seen[N:2 * N]
    assert seen[2 * N:] == epoch_permutation(5, 2, N)[:3].tolist()


@pytest.mark.parametrize("dp", [2, 4])
def test_union_over_dp_ranks_equals_dp1(folder, dp):
    ds = PackedTokenDataset(folder, T)
    ref, ranks = _ranks(ds, 1), _ranks(ds, dp)
    assert ranks[0].grad_accum_steps == 8 // (dp * 2)
    for _ in range(9):  # 72 samples: past the end of the first epoch
        assert _step_ids(ranks) == _step_ids(ref)


@pytest.mark.parametrize("new_dp", [1, 4])
def test_resume_with_another_dp_size(folder, new_dp):
    ds = PackedTokenDataset(folder, T)
    ref = _ranks(ds, 1)
    uninterrupted = [_step_ids(ref) for _ in range(8)]
    before = _ranks(ds, 2)
    consumed = [_step_ids(before) for _ in range(3)]
    states = [ld.state_dict() for ld in before]
    assert all(s == states[0] for s in states) and states[0]["position"] == 3 * 8
    after = _ranks(ds, new_dp)
    for ld in after:
        ld.load_state_dict(json.loads(json.dumps(states[0])))  # survives a JSON checkpoint
    resumed = [_step_ids(after) for _ in range(5)]
    assert consumed + resumed == uninterrupted


def test_bad_layouts_and_states_are_one_line_errors(folder):
    ds = PackedTokenDataset(folder, T)
    with pytest.raises(ValueError, match="data.global_batch=6 is not divisible by dp_size=4"):
        BatchLoader(ds, 6, 1, 0, 4, seed=0)
    with pytest.raises(ValueError, match="data.micro_batch=3"):
        BatchLoader(ds, 8, 3, 0, 2, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        BatchLoader(ds, 8, 2, 2, 2, seed=0)
    with pytest.raises(ValueError, match="data.seed=1") as e:
        BatchLoader(ds, 8, 2, 0, 1, seed=1).load_state_dict(
            BatchLoader(ds, 8, 2, 0, 1, seed=0).state_dict())
    assert "\n" not in str(e.value)


def _windows(ds: PackedTokenDataset, ids) -> list[tuple[int, int]]:
    return [(int(i) * ds.seq_len, (int(i) + 1) * ds.seq_len) for i in ids]


@pytest.mark.parametrize("dp", [1, 2])
def test_block_shuffle_resumes_at_another_seq_len(folder, dp):
    """Blocks of 64 tokens: 3 steps at T=16 (2 blocks and a half), then the same run resumed at
    T=32 consumes the rest of the epoch: every token of the whole blocks exactly once."""
    short, long = PackedTokenDataset(folder, 16), PackedTokenDataset(folder, 32)
    first = [BatchLoader(short, 4, 1, r, dp, seed=3, block_tokens=64) for r in range(dp)]
    spans = []
    for _ in range(3):
        spans += _windows(short, _step_ids(first))
    after = [BatchLoader(long, 2, 1, r, dp, seed=3, block_tokens=64) for r in range(dp)]
    for ld in after:
        ld.load_state_dict(json.loads(json.dumps(first[0].state_dict())))
    assert after[0].resume_note.startswith("data: seq_len 16 -> 32: continues at token 192 ")
    assert "(block 3, offset 0)" in after[0].resume_note
    n_blocks = after[0].num_units
    while after[0].position < n_blocks * 2:  # the epoch in windows of 32
        spans += _windows(long, _step_ids(after))
    tokens = sorted(t for a, b in spans for t in range(a, b))
    assert tokens == list(range(n_blocks * 64))  # each token of the whole blocks once
    blocks = [a // 64 for a, _ in spans[::4]]  # the order is by block, not by window
    assert blocks != sorted(blocks)


def test_block_shuffle_state_errors(folder):
    ds = PackedTokenDataset(folder, 16)
    with pytest.raises(ValueError, match="data.shuffle_block_tokens=40 must be a multiple"):
        BatchLoader(ds, 4, 1, 0, 1, seed=0, block_tokens=40)
    plain = BatchLoader(ds, 4, 1, 0, 1, seed=0).state_dict()
    with pytest.raises(ValueError, match="data.shuffle_block_tokens=None"):
        BatchLoader(ds, 4, 1, 0, 1, seed=0, block_tokens=64).load_state_dict(plain)
    with pytest.raises(ValueError, match="data.seq_len=16; resume at that length"):
        BatchLoader(PackedTokenDataset(folder, 32), 4, 1, 0, 1, seed=0).load_state_dict(plain)

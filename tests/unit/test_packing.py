"""A packed batch of several documents computes exactly what each document computes alone."""

import torch

from model.packing import Packing, cu_seqlens_from_doc_ids
from tests.helpers.tiny import tiny_model

DOC_LENS = [[5, 20, 7], [32]]  # two rows of T=32: row 0 holds three documents


def _packed_batch(vocab=512, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(DOC_LENS), T), generator=g)
    doc = torch.cat([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                     for r in DOC_LENS]).view(len(DOC_LENS), T)
    doc = doc + 10 * torch.arange(len(DOC_LENS))[:, None]
    return ids, cu_seqlens_from_doc_ids(doc)


def _docs(ids):
    """(row, start, end) of every document."""
    out = []
    for r, lens in enumerate(DOC_LENS):
        s = 0
        for n in lens:
            out.append((r, s, s + n))
            s += n
    return out


def test_cu_seqlens_and_positions():
    ids, cu = _packed_batch()
    assert cu.tolist() == [0, 5, 25, 32, 64]
    p = Packing(2, 32, ids.device, cu)
    assert p.pos_in_doc[0, :6].tolist() == [0, 1, 2, 3, 4, 0]
    assert p.pos_in_doc[1, -1].item() == 31


def _compare(fn_packed, fn_alone, ids, cu):
    full = fn_packed(ids, Packing(*ids.shape, ids.device, cu))
    for r, s, e in _docs(ids):
        alone = fn_alone(ids[r:r + 1, s:e], Packing(1, e - s, ids.device, None))
        torch.testing.assert_close(full[r:r + 1, s:e], alone, rtol=1e-5, atol=1e-5)


def test_kda_short_conv_and_mla_reset_per_document():
    model = tiny_model()
    ids, cu = _packed_batch()
    emb = model.embed_tokens
    kda, mla = model.layers["1"].self_attn, model.layers["3"].self_attn
    assert type(kda).__name__ == "KimiDeltaAttention" and type(mla).__name__ == "GatedMLA"
    conv = kda.q_conv1d
    with torch.no_grad():
        for f in (lambda x, p: conv(emb(x), p.pos_in_doc),
                  lambda x, p: kda(emb(x), p),
                  lambda x, p: mla(emb(x), p)):
            _compare(f, f, ids, cu)


def test_whole_model_packed_equals_documents_alone():
    model = tiny_model()
    ids, cu = _packed_batch()
    with torch.no_grad():
        _compare(lambda x, p: model.hidden_states(x, p.cu_seqlens),
                 lambda x, p: model.hidden_states(x), ids, cu)


def test_packing_matters():
    """Without the boundaries the later documents see earlier ones (so the test above can fail)."""
    model = tiny_model()
    ids, cu = _packed_batch()
    with torch.no_grad():
        a = model.hidden_states(ids, cu)
        b = model.hidden_states(ids)
    assert (a[0, 5:25] - b[0, 5:25]).abs().max() > 1e-3
    torch.testing.assert_close(a[0, :5], b[0, :5])


def test_rejects_bad_boundaries_on_the_host():
    """Validation happens on the host copy, before anything moves (`Packing.from_host`, and the
    model when given host boundaries); the device-side constructor reads no data."""
    import pytest

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="row start"):
        Packing.from_host(torch.tensor([0, 2, 6, 8]), 2, 4, cpu)
    with pytest.raises(ValueError, match="from 0 to B\\*T=8"):
        Packing.from_host(torch.tensor([0, 4, 7]), 2, 4, cpu)
    with pytest.raises(ValueError, match="decrease"):
        Packing.from_host(torch.tensor([0, 4, 3, 4, 8]), 2, 4, cpu)
    with pytest.raises(ValueError, match="row start"):
        tiny_model().hidden_states(torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 2, 6, 8]))
    assert Packing.from_host(torch.tensor([0, 3, 4, 8]), 2, 4, cpu).max_seqlen == 4


def test_trailing_empty_documents_change_nothing():
    """Pipeline stages get boundaries padded with empty documents (repeats of B*T)."""
    model = tiny_model()
    ids, cu = _packed_batch()
    padded = torch.cat([cu, cu[-1:].repeat(3)])
    p = Packing(*ids.shape, ids.device, padded)
    assert torch.equal(p.doc_ids, Packing(*ids.shape, ids.device, cu).doc_ids)
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states(ids, p), model.hidden_states(ids, cu),
                                   rtol=1e-6, atol=1e-6)


def test_max_seqlen_bucket_is_a_bound_with_few_values():
    from model.packing import max_seqlen_bucket

    got = {n: max_seqlen_bucket(n, 1000) for n in range(1, 1001)}
    assert all(n <= b <= 1000 for n, b in got.items())
    assert sorted(set(got.values())) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]

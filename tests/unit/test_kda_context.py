"""KCP (`model.ops.kda_context`): a row split into 1..8 context shards, each shard's state map
composed from the shards before it, equals the token recurrence over the whole rows (float64),
forward and gradients, with documents starting inside shards and exactly at their edges, and
with or without a state entering the first shard. The shards run in one process here, stacked
where `parallel.context_parallel` all-gathers them (its 2- and 4-rank runs:
`tests/distributed/test_context_parallel.py`)."""

from __future__ import annotations

import pytest
import torch

from model.ops.kda import KDAGate, kda_prologue, recurrent_kda
from model.ops.kda_context import corrected_output, fragment_pass, incoming_states
from model.packing import Packing

B, T, H, D = 2, 840, 2, 4  # 840 = lcm(1..8): every shard count divides the rows
# row 0: documents start at 0, 105 (the edge of 8 shards), 300, 301 (length 1), 700;
# row 1: one document of 840 tokens (crosses every shard edge)
CU = torch.tensor([0, 105, 300, 301, 700, 840, 1680], dtype=torch.int32)


def _inputs(seed: int = 0):
    """Weak decay and small beta, so that a state crosses several shards (~0.5 of it survives
    105 tokens) and a wrong map would show."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, f = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    b = torch.randn(B, T, H, generator=g, dtype=torch.float64) * 0.5 - 4.0
    gate = KDAGate(torch.randn(H, generator=g, dtype=torch.float64) * 0.1,
                   torch.randn(H * D, generator=g, dtype=torch.float64) * 0.5 - 8.0, -5.0)
    return [x.requires_grad_() for x in (q, k, v, f, b)], gate


def _oracle(xs, gate, s0):
    q, k, g, beta = kda_prologue(xs[0], xs[1], xs[3], xs[4], gate)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, xs[2], g, beta)]
    init = None
    if s0 is not None:  # the state entering each row's first document
        init = torch.zeros(CU.numel() - 1, H, D, D, dtype=torch.float64)
        init = init.index_copy(0, torch.tensor([0, 5]), s0)
    o, _ = recurrent_kda(*flat, initial_state=init, cu_seqlens=CU)
    return o.view(B, T, H, D)


def _sharded(xs, gate, n, s0):
    full = Packing.from_host(CU, B, T, "cpu")
    shards = [full.shard(r, n) for r in range(n)]
    L = T // n
    maps = []
    for r, p in enumerate(shards):
        ctx = p.context
        carry = ctx.carry | torch.tensor(r == 0 and s0 is not None)  # a state before the rows
        flat = [x[:, ctx.start:ctx.start + L].reshape(1, B * L, *x.shape[2:]) for x in xs]
        maps.append(fragment_pass(*flat, p.cu_seqlens, ctx.first_doc, carry, ctx.last_doc,
                                  chunk_size=16, gate=gate))
    M = torch.stack([m for m, _, _ in maps])  # [n, B, H, D, D]: what the all-gather delivers
    S = torch.stack([s for _, s, _ in maps])
    outs = []
    for r, (_, _, o_wide) in enumerate(maps):
        state = incoming_states(M, S, r, initial=s0)
        outs.append(corrected_output(o_wide, state).view(B, L, H, D))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("n, with_state", [*((n, False) for n in range(1, 9)),
                                           *((n, True) for n in (1, 4, 7))])
def test_shards_compose_to_the_recurrence(n, with_state):
    xs, gate = _inputs()
    s0 = (torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(1),
                      dtype=torch.float64) if with_state else None)
    ref = _oracle(xs, gate, s0)
    got = _sharded(xs, gate, n, s0)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)
    w = torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g_ref = torch.autograd.grad((ref * w).sum(), xs)
    g_got = torch.autograd.grad((got * w).sum(), xs)
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_a_document_start_cuts_the_chain():
    """The map of a shard in which a document starts passes nothing of the entering state."""
    xs, gate = _inputs()
    p = Packing.from_host(CU, B, T, "cpu").shard(2, 8)  # tokens 210..315 of each row
    L = T // 8
    flat = [x[:, 210:315].reshape(1, B * L, *x.shape[2:]) for x in xs]
    M, _, _ = fragment_pass(*flat, p.cu_seqlens, p.context.first_doc, p.context.carry,
                            p.context.last_doc, chunk_size=16, gate=gate)
    assert p.context.carry.tolist() == [True, True]
    assert M[0].abs().max() == 0  # row 0: documents start at 300 and 301
    assert M[1].abs().max() > 0.3  # row 1: one document passes straight through

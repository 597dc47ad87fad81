"""MoonEPDispatcher (gloo, 2 and 4 ranks) against a one-process MoE reference.

Every rank builds the same full problem (all ranks' tokens, all experts' weights) from a fixed
seed and computes the reference with `LocalDispatcher` + `grouped_mm` + `situ_glu` on all tokens.
Under EP each rank takes its token slice and its home experts' weights as leaves, dispatches, runs
`grouped_mm` over `gather_expert_weights`, and combines. Outputs and gradients (tokens, routing
weights, home expert weights) must match the reference slice within 1e-5, for replicas on/off and
pad_multiple 1/32; plus exact balance with a hot expert, ranks with no tokens, an unused expert,
the fetched replica weights, and bit-identical reruns.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks

EPN, L, M, K = 2, 8, 16, 2  # experts per rank, latent, intermediate, top-k
HOT, UNUSED = 1, 2  # expert ids forced hot / unused by the routing modes


def _problem(world: int, sizes: list[int], route: str, seed: int = 0) -> dict:
    """The full problem, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    E, N = EPN * world, sum(sizes)
    scores = torch.rand(N, E, generator=g)
    if route == "hot":
        scores[:, HOT] = 2.0  # every token's first choice
    elif route == "unused":
        scores[:, UNUSED] = -1.0  # never chosen
    return dict(
        x=torch.randn(N, L, generator=g), idx=scores.topk(K).indices,
        wts=torch.rand(N, K, generator=g),
        ws=[torch.randn(E, M, L, generator=g) * 0.3, torch.randn(E, M, L, generator=g) * 0.3,
            torch.randn(E, L, M, generator=g) * 0.3],
        gout=torch.randn(N, L, generator=g))


def _moe(disp, x, idx, wts, ws, gather):
    from model.ops.grouped_gemm import grouped_mm
    from model.ops.situ import situ_glu

    xg, sizes, handle = disp.dispatch(x, idx, wts)
    w1, w3, w2 = gather(handle, *ws)
    h = situ_glu(grouped_mm(xg, w1, sizes), grouped_mm(xg, w3, sizes))
    return disp.combine(grouped_mm(h, w2, sizes), handle), handle, (w1, w3, w2)


def _run(p: dict, lo: int, hi: int, disp, gather, home: slice | None = None):
    """Forward + backward of (out * gout).sum() on tokens [lo, hi) with leaf copies of the
    weights (only the `home` experts when given). Returns (out, grads, handle, gemm weights)."""
    x = p["x"][lo:hi].clone().requires_grad_()
    wts = p["wts"][lo:hi].clone().requires_grad_()
    ws = [(w if home is None else w[home]).clone().requires_grad_() for w in p["ws"]]
    out, handle, gemm_ws = _moe(disp, x, p["idx"][lo:hi], wts, ws, gather)
    (out * p["gout"][lo:hi]).sum().backward()
    return out.detach(), [x.grad, wts.grad] + [w.grad for w in ws], handle, gemm_ws


def _close(a: torch.Tensor, b: torch.Tensor, tag: str, tol: float = 1e-5) -> None:
    """|a - b| <= tol * (1 + |b|) elementwise (torch.testing.assert_close would import
    torch.distributed.tensor and sympy in every rank: ~3 s)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (tag, a.shape, b.shape, a.dtype, b.dtype)
    err = ((a - b).abs() - tol * (1 + b.abs())).max() if a.numel() else torch.tensor(-1.0)
    assert err <= 0, f"{tag}: max |a - b| = {(a - b).abs().max():.3g}"


def _check(rank: int, world: int, sizes: list[int], route: str, replicas: bool, pad: int,
           rerun: bool = False):
    """EP vs reference on this rank's slice; returns the EP handle and GEMM-view weights."""
    from model.dispatch import LocalDispatcher
    from moonep import MoonEPDispatcher

    p = _problem(world, sizes, route)
    E = EPN * world
    out_ref, g_ref, _, _ = _run(p, 0, sum(sizes), LocalDispatcher(E), lambda h, *w: w)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    home = slice(rank * EPN, (rank + 1) * EPN)
    disp = MoonEPDispatcher(None, E, replicas=replicas, pad_multiple=pad)
    out, grads, handle, gemm_ws = _run(p, lo, hi, disp, disp.gather_expert_weights, home)
    tag = f"{route} sizes={sizes} replicas={replicas} pad={pad} rank={rank}"
    _close(out, out_ref[lo:hi], f"{tag} out")
    _close(grads[0], g_ref[0][lo:hi], f"{tag} grad x")
    _close(grads[1], g_ref[1][lo:hi], f"{tag} grad topk_weight")
    for i, (g, gr) in enumerate(zip(grads[2:], g_ref[2:])):  # replica grads summed back
        _close(g, gr[home], f"{tag} grad w{(1, 3, 2)[i]}")
    assert int(handle.route.pair_sizes.sum()) == handle.route.recv_rows.numel()
    assert handle.route.num_rows % pad == 0
    if rerun:  # bit-identical outputs and gradients
        out2, grads2, _, _ = _run(p, lo, hi, disp, disp.gather_expert_weights, home)
        assert torch.equal(out, out2), tag
        assert all(torch.equal(a, b) for a, b in zip(grads, grads2)), tag
    return p, handle, gemm_ws


def _reference_cases(rank: int, world: int) -> None:
    sizes = [5, 3, 4, 6][:world]
    for replicas in (True, False):
        for pad in (1, 32):
            _, handle, gemm_ws = _check(rank, world, sizes, "random", replicas, pad,
                                        rerun=replicas and pad == 32)
            n_groups = 2 * EPN if replicas else EPN
            assert handle.route.group_experts.numel() == n_groups
            assert all(w.shape[0] == n_groups for w in gemm_ws)


def _edge_cases(rank: int, world: int) -> None:
    from moonep import rank_targets, static_load

    S = 6
    # one hot expert: replicas must spread it so every rank processes exactly S*K pairs
    for replicas in (True, False):
        p, handle, gemm_ws = _check(rank, world, [S] * world, "hot", replicas, 1)
        plan = handle.route.plan
        if replicas:
            assert int(handle.route.pair_sizes.sum()) == S * K
            assert torch.equal(plan.rank_load, rank_targets(world * S * K, world))
            assert int(plan.slots_used.sum()) > 0
            counts = plan.alloc.sum(1, keepdim=True).t()
            assert int(static_load(counts, world).max()) > S * K  # unbalanced without replicas
            slot_experts = handle.route.group_experts[EPN:]
            for w, w_full in zip(gemm_ws, p["ws"]):
                assert not w.is_leaf and w.requires_grad  # replicas never become parameters
                assert torch.equal(w[:EPN], w_full[rank * EPN:(rank + 1) * EPN])
                expect = torch.where((slot_experts >= 0).view(-1, 1, 1),
                                     w_full[slot_experts.clamp(min=0)], 0.0)
                assert torch.equal(w[EPN:], expect)  # fetched from the home ranks
        else:
            assert int(plan.slots_used.sum()) == 0
            assert gemm_ws[0].is_leaf
    # ranks without tokens (rank 1 in both; only rank 0 has tokens in the second), hot routing
    _check(rank, world, [5, 0, 4, 3][:world], "hot", True, 32)
    _check(rank, world, [7] + [0] * (world - 1), "hot", True, 1)
    _check(rank, world, [7] + [0] * (world - 1), "random", False, 32)
    # an expert nobody routes to
    for replicas in (True, False):
        _, handle, _ = _check(rank, world, [4] * world, "unused", replicas, 32)
        assert int(handle.route.plan.alloc[UNUSED].sum()) == 0
        if rank == UNUSED // EPN:
            assert int(handle.route.pair_sizes[UNUSED % EPN]) == 0


def _fp8_payload(rank: int, world: int) -> None:
    """fp8 tokens travel as bytes (gloo rejects fp8): same rows as the fp32 path, cast."""
    from moonep import MoonEPDispatcher

    p = _problem(world, [3] * world, "hot")
    x, idx, wts = (p[n][3 * rank:3 * rank + 3] for n in ("x", "idx", "wts"))
    disp = MoonEPDispatcher(None, EPN * world, replicas=True, pad_multiple=32)
    xg8, sizes8, h8 = disp.dispatch(x.to(torch.float8_e4m3fn), idx, wts)
    xg, sizes, h = disp.dispatch(x, idx, wts)
    assert torch.equal(sizes8, sizes)
    assert torch.equal(xg8.view(torch.uint8), xg.to(torch.float8_e4m3fn).view(torch.uint8))
    y8 = disp.combine(xg8, h8)  # [S, l] fp32 from fp8 rows
    _close(y8, disp.combine(xg.to(torch.float8_e4m3fn).float(), h), "fp8 combine", tol=0.0)


def _all_cases(rank: int, world: int) -> None:
    _reference_cases(rank, world)
    _edge_cases(rank, world)
    _fp8_payload(rank, world)
    _host_reads_collectives_and_reuse(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_moonep_dispatch_matches_local_reference(world: int) -> None:
    """One spawn per world size (~3-6 s of start-up each) runs every case."""
    run_ranks(_all_cases, world)



def _host_reads_collectives_and_reuse(rank: int, world: int) -> None:
    """One dispatch reads the host once; a layer's forward is 1 all_gather + 3 all-to-alls
    (tokens, all replica weights in one, combine) and its backward 3 all-to-alls, every payload
    in the bf16 of x and the weights (replica gradients are not widened to fp32 on the wire);
    a saved route (activation-checkpoint recompute) reproduces the dispatch with no host read."""
    import torch.distributed as dist

    from moonep import MoonEPDispatcher, dispatch, replicas
    from train.observe.host_syncs import HostSyncCounter

    p = _problem(world, [6] * world, "hot")
    disp = MoonEPDispatcher(None, EPN * world, replicas=True)
    rows = slice(6 * rank, 6 * rank + 6)
    idx, wts = p["idx"][rows], p["wts"][rows]
    with HostSyncCounter() as c:
        route = disp.route(idx)
    assert dict(c.counts) == {"Tensor.tolist": 1}, dict(c.counts)

    calls: list[tuple[str, torch.dtype]] = []
    real_a2a, real_gather = dist.all_to_all_single, dispatch._all_gather_single

    def a2a(out, inp, *a, **kw):
        calls.append(("all_to_all", inp.dtype))
        return real_a2a(out, inp, *a, **kw)

    def gather(out, inp, *a, **kw):
        calls.append(("all_gather", inp.dtype))
        return real_gather(out, inp, *a, **kw)

    sent = []
    real_rows = replicas.all_to_all_rows

    def send_rows(t, *a, **kw):
        sent.append(t.dtype)
        return real_rows(t, *a, **kw)

    dist.all_to_all_single, dispatch._all_gather_single = a2a, gather
    replicas.all_to_all_rows = send_rows
    try:
        home = slice(rank * EPN, (rank + 1) * EPN)
        ws = [w[home].to(torch.bfloat16).requires_grad_() for w in p["ws"]]
        x = p["x"][rows].to(torch.bfloat16).requires_grad_()
        out, _, _ = _moe(disp, x, idx, wts, ws, disp.gather_expert_weights)
        assert [n for n, _ in calls] == ["all_gather", "all_to_all", "all_to_all",
                                         "all_to_all"], calls
        calls.clear()
        out.sum().backward()
        assert [n for n, _ in calls] == ["all_to_all"] * 3, calls
    finally:
        dist.all_to_all_single, dispatch._all_gather_single = real_a2a, real_gather
        replicas.all_to_all_rows = real_rows
    assert sent == [torch.bfloat16] * 6, sent
    assert all(w.grad.dtype == torch.bfloat16 for w in ws)

    x = p["x"][rows]
    fresh, sizes, _ = disp.dispatch(x, idx, wts)
    with HostSyncCounter() as c:
        again, sizes2, _ = disp.dispatch(x, idx, wts, route)
    assert c.total == 0 and torch.equal(fresh, again) and torch.equal(sizes, sizes2)

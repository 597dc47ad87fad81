"""Context-parallel ops on 2 gloo ranks against the same op on one rank over the whole rows
(float64): Ulysses MLA attention (DeepSpeed's `DistributedAttention` around our packed
attention), forward, q/k/v gradients and the per-head logit bounds; and the KCP KDA op with the
halo short convolution, forward and gradients. Documents start inside the shards, at their
edge and cross it. (One process composing 1..8 shards against the recurrence:
`tests/unit/test_kda_context.py`; whole training runs: `tests/e2e/test_context_parallel.py`.)"""

from __future__ import annotations

from tests.helpers.dist import run_ranks


def _cp_ops_equal_one_rank(rank: int, world: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from model.kda import local_kda
    from model.ops.attention import packed_causal_attention
    from model.ops.kda import KDAGate
    from model.ops.short_conv import short_conv_silu
    from model.packing import Packing
    from model.short_conv import ShortConv
    from parallel.context_parallel import _halo_conv, kcp_kda, own_ulysses, ulysses_attention

    B, T, H, D = 2, 32, 4, 8
    L = T // world
    cu = torch.tensor([0, 5, 16, 27, 32, 64], dtype=torch.int32)  # 16 = the shard edge
    full = Packing.from_host(cu, B, T, "cpu")
    shard = full.shard(rank, world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    def local(x):  # this rank's slice of whole-row tensors, as a leaf
        return x.detach()[:, rank * L:(rank + 1) * L].clone().requires_grad_()

    def check(got, ref, tol=1e-10):
        torch.testing.assert_close(got, ref[:, rank * L:(rank + 1) * L], rtol=tol, atol=tol)

    # Ulysses attention
    q, k, v = rand(B, T, H, 12), rand(B, T, H, 12), rand(B, T, H, 8)
    ref, bound_ref = packed_causal_attention(q, k, v, full, 0.3, logit_bound=True)
    w = torch.randn(B, T, H, 8, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    half = H // world  # heads per rank inside the attention
    for name in ("deepspeed", "own"):
        ql, kl, vl = local(q), local(k), local(v)
        if name == "deepspeed":  # what `GatedMLA.attention` becomes under cp
            got, bound = ulysses_attention(group, world, "gloo")(ql, kl, vl, shard, 0.3,
                                                                  logit_bound=True)
            torch.testing.assert_close(bound, bound_ref, rtol=1e-6, atol=1e-6)  # every head
        else:  # the fallback on our own all-to-all; the bounds of this rank's heads
            bounds = []
            got = own_ulysses(group, world)(ql, kl, vl, full, 0.3, bounds)
            torch.testing.assert_close(bounds[0], bound_ref[rank * half:(rank + 1) * half])
        check(got, ref)
        for a, r in zip(torch.autograd.grad((got * local(w)).sum(), (ql, kl, vl)), ref_grads):
            check(a, r)

    # KCP KDA after the halo short convolution
    x = rand(B, T, H * D)
    conv = ShortConv(H * D, 4).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(H * D, 1, 4, generator=g, dtype=torch.float64))
    f, b = rand(B, T, H, D), rand(B, T, H)
    gate = KDAGate(torch.zeros(H, dtype=torch.float64),
                   torch.full((H * D,), -6.0, dtype=torch.float64), -5.0)

    def kda(op, xs, packing):
        y = short_conv_silu(xs[0], conv.weight[:, 0], packing.pos_in_doc) if op is None else \
            op(xs[0], packing.pos_in_doc)
        qkv = y.view(*y.shape[:2], H, D)
        return (local_kda if op is None else kcp)(qkv, qkv * 0.5, qkv, xs[1], xs[2], packing,
                                                  gate, 8)

    kcp = kcp_kda(group, rank, world)
    ref = kda(None, (x, f, b), full)
    w = torch.randn(*ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), (x, f, b, conv.weight))
    _halo_conv(conv, group, rank, world)
    xs = (local(x), local(f), local(b))
    got = kda(conv.forward, xs, shard)
    check(got, ref)
    grads = torch.autograd.grad((got * local(w)).sum(), (*xs, conv.weight))
    for a, r in zip(grads[:3], ref_grads[:3]):
        check(a, r)
    dw = grads[3].clone()
    torch.distributed.all_reduce(dw, group=group)  # each rank's share of the weight gradient
    torch.testing.assert_close(dw, ref_grads[3], rtol=1e-10, atol=1e-10)


def test_ulysses_and_kcp_equal_one_rank():
    run_ranks(_cp_ops_equal_one_rank, 2)

"""Muon over FSDP2-sharded parameters (`train.optim.muon_dist`) equals the single-device optimizer:
3 gloo ranks split the rows unevenly, so heads straddle ranks and take the owner exchange while
expert stacks stay local; two steps with the same gradients, parameters compared in full."""

from __future__ import annotations

from tests.helpers.dist import run_ranks


def _muon_sharded_equals_single_device(rank: int, world: int) -> None:
    import torch
    from torch.distributed.tensor import distribute_tensor

    from tests.helpers.tiny import fsdp_debug_pair
    from train.optim.muon import MuonAdamW, muon_blocks

    sharded, ref = fsdp_debug_pair(world)
    opt = MuonAdamW(sharded, lr=0.02, weight_decay=0.1)
    opt_ref = MuonAdamW(ref, lr=0.02, weight_decay=0.1)
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        for i, (name, p) in enumerate(sharded.named_parameters()):
            g = torch.Generator().manual_seed(1000 * step + i)
            full = torch.randn(p.shape, generator=g)
            ref_params[name].grad = full.clone()
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        opt.step()
        opt_ref.step()
    blocks = muon_blocks(ref)
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), rtol=1e-5,
                                   atol=1e-6, msg=name)
    assert any(n in blocks for n in ref_params)
    exchanged = [e for e in opt._exchanges.values()]
    assert exchanged and sum(e.exchange_bytes(4) for e in exchanged) > 0  # owners were used


def test_muon_over_fsdp_equals_one_device():
    run_ranks(_muon_sharded_equals_single_device, 3)

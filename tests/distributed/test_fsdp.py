"""FSDP2 materialisation and gradients against the single-device model (gloo, 2 ranks)."""

from __future__ import annotations

import torch

from tests.helpers.dist import run_ranks


def _sharded_equals_single_device(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tests.helpers.tiny import fsdp_debug_pair

    sharded, ref = fsdp_debug_pair(world)
    ref_params = dict(ref.named_parameters())
    n_sharded = 0
    for name, p in sharded.named_parameters():
        assert isinstance(p, DTensor), name
        n_sharded += p.to_local().numel()
        assert torch.equal(p.full_tensor(), ref_params[name].detach()), name
    total = sum(p.numel() for p in ref.parameters())
    assert n_sharded < total  # each rank really holds only part of the weights

    # one forward/backward on different halves of a batch: summed sharded grads == full grads
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (4, 32), generator=g)
    labels = torch.roll(ids, -1, 1)
    s, n = sharded(ids[2 * rank:2 * rank + 2], labels=labels[2 * rank:2 * rank + 2])
    (s * world / 128).backward()  # FSDP averages over ranks; 128 target tokens in the batch
    s_ref, n_ref = ref(ids, labels=labels)
    (s_ref / 128).backward()
    total_loss = s.detach().clone()
    dist.all_reduce(total_loss)
    torch.testing.assert_close(total_loss, s_ref.detach(), rtol=1e-5, atol=1e-5)
    for name, p in sharded.named_parameters():
        if ref_params[name].grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_fsdp_materialisation_and_gradients_match_single_device():
    run_ranks(_sharded_equals_single_device, 2)

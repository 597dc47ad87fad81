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
    _assert_grads_match(sharded, ref)


def _assert_grads_match(sharded, ref) -> None:
    """Every sharded gradient (gathered) equals the single-device model's."""
    ref_params = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        if ref_params[name].grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_fsdp_materialisation_and_gradients_match_single_device():
    run_ranks(_sharded_equals_single_device, 2)


def _accumulation_keeps_units_gathered(rank: int, world: int) -> None:
    """Two micro-batches per rank, units built with reshard_after_forward=False (as the trainer
    does for `parallel.reshard_after_forward=false`) and `set_gradient_sync(keep_gathered=True)`:
    one all-gather per unit for the whole step, where the same model without keep_gathered
    gathers every unit again each micro-batch; the gradients equal the single-device model's on
    the whole batch."""
    import torch.distributed as dist

    from parallel.fsdp import set_gradient_sync
    from tests.helpers.tiny import fsdp_debug_pair

    gathers = [0]
    # FSDP2's all-gather: dist.all_gather_single (torch >= 2.13) or all_gather_into_tensor
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name: str):
        def call(*args, **kwargs):
            gathers[0] += 1
            return real[name](*args, **kwargs)
        return call

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (8, 32), generator=g)
    labels = torch.roll(ids, -1, 1)
    mine = ids[4 * rank:4 * rank + 4], labels[4 * rank:4 * rank + 4]

    def step(model, keep: bool, micro: int) -> int:
        gathers[0] = 0
        rows = 4 // micro
        for i in range(micro):
            set_gradient_sync(model, i == micro - 1, keep_gathered=keep)
            s, _ = model(mine[0][i * rows:(i + 1) * rows],
                         labels=mine[1][i * rows:(i + 1) * rows])
            (s * world / 256).backward()  # FSDP averages over ranks; 256 targets in the batch
        return gathers[0]

    for n in names:
        setattr(dist, n, counting(n))
    try:
        regathering = step(fsdp_debug_pair(world, reshard_after_forward=False)[0], keep=False,
                           micro=2)
        sharded, ref = fsdp_debug_pair(world, reshard_after_forward=False)
        kept = step(sharded, keep=True, micro=2)
    finally:
        for n in names:
            setattr(dist, n, real[n])
    units = len(sharded.decoder_layers()) + 1
    assert (kept, regathering) == (units, 2 * units), (kept, regathering, units)
    s_ref, _ = ref(ids, labels=labels)
    (s_ref / 256).backward()
    _assert_grads_match(sharded, ref)


def test_gradient_accumulation_keeps_units_gathered_and_matches_single_device():
    run_ranks(_accumulation_keeps_units_gathered, 2)

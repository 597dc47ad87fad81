"""Gradient-accumulation fusion (`parallel.grad_accumulation`) against the unfused runs.

Two ranks of the debug model (KDA, MLA, dense and MoE layers), three micro-batches each, two
steps: the weight-gradient GEMMs add into the installed buffers (their fused ops run; the fused
weights never get a `.grad` of their own) and FSDP2 reduce-scatters those buffers. In fp32
every sharded gradient equals the single-device gradient of the whole batch; the second step
proves the buffers are zeroed and installed again. With bf16 compute (FSDP2's mixed-precision
path, fp32 buffers) the reference is the same FSDP2 model without fusion, which rounds each
micro-batch's weight gradient to bf16 before adding it: the fused gradients differ from it by
that rounding only, and every gradient the fusion does not touch is identical.
"""

from __future__ import annotations

import torch

from tests.helpers.dist import run_ranks

MICRO, ROWS, SEQ = 3, 2, 32


def _batches(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, 512, (world * MICRO * ROWS, SEQ), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _accumulate(model, rank: int, world: int, step: int, mains=None) -> None:
    from parallel.fsdp import set_gradient_sync

    ids, labels = _batches(world, step)
    mine = ids[rank::world], labels[rank::world]
    tokens = ids.numel()
    if mains is not None:
        mains.begin_step()
    for i in range(MICRO):
        set_gradient_sync(model, i == MICRO - 1)
        sl = slice(i * ROWS, (i + 1) * ROWS)
        s, _ = model(mine[0][sl], labels=mine[1][sl])
        (s * world / tokens).backward()
        for fp in (mains.fsdp_params if mains is not None else []):
            assert fp._unsharded_param.grad is None, fp._module_info.param_name


def _fused_accumulation(rank: int, world: int, param_dtype: str) -> None:
    from model.ops import wgrad
    from parallel.grad_accumulation import attach_main_grads
    from tests.helpers.tiny import fsdp_debug_pair

    calls = {"dense": 0, "grouped": 0}
    real = wgrad.wgrad_accumulate, wgrad.grouped_wgrad_accumulate

    def dense(*a):
        calls["dense"] += 1
        return real[0](*a)

    def grouped(*a):
        calls["grouped"] += 1
        return real[1](*a)

    wgrad.wgrad_accumulate, wgrad.grouped_wgrad_accumulate = dense, grouped
    sharded, ref = fsdp_debug_pair(world, param_dtype=param_dtype)
    unfused = fsdp_debug_pair(world, param_dtype=param_dtype)[0] if param_dtype != "fp32" else None
    mains = attach_main_grads(sharded, torch.float32, torch.device("cpu"))
    kinds = {type(fp._module_info.module).__name__ for fp in mains.fsdp_params}
    assert kinds == {"Linear", "RoutedExperts"}, kinds
    fused = {id(fp) for fp in mains.fsdp_params}
    for step in range(2):
        _accumulate(sharded, rank, world, step, mains)
        if unfused is None:
            ids, labels = _batches(world, step)
            ref.zero_grad(set_to_none=True)
            s_ref, _ = ref(ids, labels=labels)
            (s_ref / ids.numel()).backward()
            want_grads = {n: p.grad for n, p in ref.named_parameters()}
        else:
            _accumulate(unfused, rank, world, step)
            want_grads = {n: None if p.grad is None else p.grad.full_tensor()
                          for n, p in unfused.named_parameters()}
            unfused.zero_grad(set_to_none=True)
        for (name, p), fp in zip(sharded.named_parameters(), _fsdp_param_list(sharded)):
            want = want_grads[name]
            assert (p.grad is None) == (want is None), name
            if p.grad is None:
                continue
            got = p.grad.full_tensor()
            assert p.grad.dtype == p.dtype
            if unfused is None:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
            elif id(fp) not in fused:
                assert torch.equal(got, want), name
            else:  # the unfused run's bf16 rounding of each micro-batch's gradient
                err = ((got - want).norm() / want.norm()).item()
                assert 0 < err < 5e-3, (name, err)
        sharded.zero_grad(set_to_none=True)
    assert calls["dense"] > 0 and calls["grouped"] > 0, calls


def _fsdp_param_list(model) -> list:
    """FSDPParam of each of `model.named_parameters()`, in order."""
    from parallel.grad_accumulation import _fsdp_params

    by_param = {id(fp.sharded_param): fp for fp in _fsdp_params(model)}
    return [by_param[id(p)] for p in model.parameters()]


def test_fused_accumulation_matches_single_device_fp32():
    run_ranks(_fused_accumulation, 2, "fp32")


def test_fused_accumulation_bf16_compute_fp32_buffers():
    run_ranks(_fused_accumulation, 2, "bf16")


def test_nothing_fusable_attaches_nothing():
    """A model with no FSDP2 units (the single-process reference runs, fp64 verification,
    tensor-parallel or MXFP8 weights) gets no buffers: the trainer's per-step `begin_step` is
    skipped, and an empty MainGrads is a no-op rather than a failing `_foreach_zero_`."""
    from parallel.grad_accumulation import MainGrads, attach_main_grads
    from tests.helpers.tiny import tiny_model

    model = tiny_model()
    assert attach_main_grads(model, torch.float32, torch.device("cpu")) is None
    assert all(p.grad is None for p in model.parameters())
    MainGrads().begin_step()

"""Tensor + sequence parallelism on gloo: the loss and every parameter gradient of the debug
model equal the single-device model's on the same packed batch (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks


def _grads_tp(rank: int, world: int, dims_tp: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from model.build import build_model
    from model.init import init_weights
    from parallel.fsdp import dtensor_writer
    from parallel.tensor_parallel import (
        allreduce_replicated_grads,
        apply_tensor_parallel,
        tp_replicated_params,
    )
    from tests.helpers.tiny import packed_batch

    mesh = init_device_mesh("cpu", (dims_tp,), mesh_dim_names=("tp",))
    model = build_model("debug", device="meta")
    apply_tensor_parallel(model, mesh)
    model.to_empty(device="cpu")
    init_weights(model, 0, write=dtensor_writer)
    ids, labels, cu = packed_batch()
    loss, _ = model(ids, cu, labels=labels)
    total = loss.detach().clone()  # vocabulary-parallel loss: the full sum on every tp rank
    loss.backward()
    allreduce_replicated_grads(tp_replicated_params(model.parameters(), mesh), mesh.get_group())
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"loss": total, "grads": grads}, path)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_grads_equal_single_device(tmp_path, tp):
    from model.build import build_model
    from tests.helpers.tiny import packed_batch

    path = str(tmp_path / "tp.pt")
    run_ranks(_grads_tp, tp, tp, path)
    got = torch.load(path)
    model = build_model("debug", seed=0)
    ids, labels, cu = packed_batch()
    loss, _ = model(ids, cu, labels=labels)
    loss.backward()
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-5)
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got["grads"].keys() == ref.keys()
    for n, g in ref.items():  # loss sums: gradients reach ~10; fp32 rounding scales with them
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-5 * g.abs().max(),
                                   msg=lambda m, n=n: f"{n}: {m}")

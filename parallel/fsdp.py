"""FSDP2 (`fully_shard`) for the K3 model, and materialising a sharded meta model.

Each decoder layer is its own FSDP unit, then the root (embedding, final mix/norm, LM head).
Mixed precision on GPU: bf16 parameters for compute, fp32 gradient reduction; fp32 on CPU.
`dtensor_writer` lets `model.init.init_weights` fill full tensors and keep only the local shard,
so a sharded model starts with exactly the weights of a single-device build.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}

# A decoder layer passes the AttnRes snapshot tensor through unchanged; FSDP's backward hook makes
# that a view and warns about in-place ops on it. Nothing writes to it in place (the decoder only
# uses `torch.cat` and out-of-place adds), so the warning is noise here.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def apply_fsdp(model: nn.Module, mesh, param_dtype: str = "fp32", reduce_dtype: str = "fp32",
               reshard_after_forward: bool = True,
               ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """`ignored_params`: parameters sharded by another scheme (expert parallelism).

    The root (embedding, output mix, head) and the last layer keep their parameters gathered
    from forward to backward (backward needs them first, so resharding would only gather them
    again), and each layer prefetches its neighbour explicitly: the next layer's all-gather in
    forward, the previous layer's in backward, issued before this layer's compute."""
    kw = fsdp_kwargs(mesh, param_dtype, reduce_dtype, reshard_after_forward, ignored_params)
    layers = model.decoder_layers()  # type: ignore[union-attr]
    for i, layer in enumerate(layers):
        fully_shard(layer, **{**kw, "reshard_after_forward":
                              reshard_after_forward and i < len(layers) - 1})
    fully_shard(model, **{**kw, "reshard_after_forward": False})
    set_prefetch(layers)
    return model


def set_prefetch(layers: list[nn.Module]) -> None:
    """Explicit FSDP prefetch along the layer order (one layer ahead, both directions)."""
    for prev, nxt in zip(layers, layers[1:]):
        prev.set_modules_to_forward_prefetch([nxt])  # type: ignore[operator]
        nxt.set_modules_to_backward_prefetch([prev])  # type: ignore[operator]


def fsdp_kwargs(mesh, param_dtype: str = "fp32", reduce_dtype: str = "fp32",
                reshard_after_forward: bool = True,
                ignored_params: set[nn.Parameter] | None = None,
                cast_forward_inputs: bool = True) -> dict:
    """Keyword arguments of `fully_shard` for one job (mixed precision, resharding).

    `cast_forward_inputs=False` for the routed experts: their routing weights stay fp32."""
    if param_dtype == "fp64":  # verification mode: float64 master weights, compute, reduction
        reduce_dtype = "fp64"
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype],
                              cast_forward_inputs=cast_forward_inputs)
    kw = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
    if ignored_params:
        kw["ignored_params"] = ignored_params
    return kw


def dtensor_writer(param: torch.Tensor, full: torch.Tensor) -> None:
    """Store `full` into `param`, which may be a DTensor: keep this rank's shard only."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def units_stay_gathered(reshard_after_forward: bool, pp: int) -> bool:
    """Whether FSDP units stay gathered over all of a step's micro-batches: under pp (the layers
    are built so, `parallel.parallelize`) or with `parallel.reshard_after_forward=false`
    (`set_gradient_sync(keep_gathered=True)`); else each micro-batch gathers them again."""
    return pp > 1 or not reshard_after_forward


def set_gradient_sync(model: nn.Module, enabled: bool, keep_gathered: bool = False) -> None:
    """Gradient accumulation: reduce-scatter only on the last micro-batch.

    `keep_gathered` (`parallel.reshard_after_forward=false`): the parameters also stay gathered
    from the first micro-batch's forward to the last one's backward, so a step all-gathers each
    unit once, as Megatron's distributed optimizer does, instead of twice per micro-batch
    (memory: the unsharded compute-dtype parameters for the whole step)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        if keep_gathered:
            model.set_reshard_after_backward(enabled)


@contextlib.contextmanager
def unsharded_root(model: nn.Module) -> Iterator[None]:
    """Gather the root's own parameters for code that does not go through `forward`."""
    if isinstance(model, FSDPModule):
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
    else:
        yield

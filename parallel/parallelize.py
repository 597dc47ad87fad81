"""Turn a model config into this rank's parallel model: pipeline split -> expert parallel ->
MXFP8 -> tensor parallel -> context parallel -> activation checkpointing -> compile -> FSDP,
then materialise.

Everything is built on the meta device and only this rank's shards are allocated and
initialised; `model.init.init_weights` draws every parameter from a generator keyed by its name,
so any layout starts from exactly the single-device weights.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from model.build import build_model
from model.init import init_weights
from model.ops.mx_linear import mx_backend
from model.precision import apply_mxfp8
from parallel.activation_checkpoint import apply_activation_checkpointing, apply_compile
from parallel.context_parallel import apply_context_parallel
from parallel.dims import Meshes, ParallelDims
from parallel.expert_parallel import apply_expert_parallel, expert_parameters
from parallel.fsdp import DTYPES, apply_fsdp, dtensor_writer, fsdp_kwargs, units_stay_gathered
from parallel.grad_accumulation import attach_main_grads
from parallel.parallel_model import ParallelModel
from parallel.pipeline import (
    LossScale,
    PipelineStageModule,
    build_schedule,
    prune_to_stages,
    split_stages,
    stage_indices,
    stage_io_meta,
)
from parallel.tensor_parallel import apply_tensor_parallel, tp_replicated_params


def parallelize(job, dims: ParallelDims, meshes: Meshes, device: torch.device,
                n_microbatches: int = 1, log=print) -> ParallelModel:
    """This rank's `ParallelModel` of `job`, materialised on `device` and initialised."""
    out, stage_modules = shard_on_meta(job, dims, meshes, meshes.pp_rank, log)
    out.stage_modules = stage_modules
    out.compiled = bool(job.parallel.compile)
    out.keep_gathered = units_stay_gathered(job.parallel.reshard_after_forward, dims.pp)
    out.device = device
    model = out.model
    model.to_empty(device=device)
    init_weights(model, job.train.seed, write=dtensor_writer)
    if out.expert_params:
        out.expert_params = expert_parameters(model)
    if fuses_grad_accumulation(job, dims, n_microbatches):
        dtype = torch.promote_types(DTYPES[job.cluster.reduce_dtype],
                                    DTYPES[job.cluster.param_dtype])
        out.main_grads = attach_main_grads(model, dtype, device,
                                           experts=not dims.expert_parallel)
    if dims.tp > 1:
        out.tp_params = tp_replicated_params(model.parameters(), meshes.tp)
    if dims.pp > 1:
        out.pipeline_loss_scale = LossScale()
        act_dtype = DTYPES[job.cluster.param_dtype]
        io = [stage_io_meta(job.model, out.splits, s, job.data.micro_batch, job.data.seq_len,
                            dims.tp, act_dtype, dims.cp) for s in out.stages]
        out.schedule = build_schedule(stage_modules, out.stages, dims.num_stages,
                                      dims.pp_schedule, meshes.pp.get_group(), device,
                                      n_microbatches, out.pipeline_loss_scale, io)
    return out


def fuses_grad_accumulation(job, dims: ParallelDims, n_microbatches: int) -> bool:
    """Whether the weight-gradient GEMMs add into FSDP2's accumulator
    (`parallel.fuse_grad_accumulation`): with 2+ micro-batches, outside pipeline parallelism."""
    return job.parallel.fuse_grad_accumulation and n_microbatches > 1 and dims.pp == 1


def shard_on_meta(job, dims: ParallelDims, meshes: Meshes, pp_rank: int, log=print
                  ) -> tuple[ParallelModel, list[PipelineStageModule]]:
    """Every parallel transform, on the meta device (also what the dry run measures); `pp_rank`
    picks the stages to keep."""
    model = build_model(job.model, device="meta")
    if job.cluster.param_dtype == "fp64":  # verification mode: float64 master weights too
        model.to(torch.float64)
    out = ParallelModel(model, dims, meshes)
    if dims.pp > 1:
        out.splits = split_stages(job.model, dims.num_stages)
        out.stages = stage_indices(pp_rank, dims.pp, dims.num_stages, dims.pp_schedule)
        prune_to_stages(model, out.splits, out.stages)
    if dims.expert_parallel:
        out.expert_params = apply_expert_parallel(
            model, meshes.ep, job.parallel.ep_replicas,
            reuse_plans=job.parallel.activation_checkpoint != "none")
    p = job.precision
    if p.gemm == "mxfp8":
        converted = apply_mxfp8(model, p.targets, p.mx_mode, p.wgrad_hp)
        dev = torch.device(job.cluster.device)
        log(f"precision: MXFP8 (linears {mx_backend(dev)}, experts "
            f"{mx_backend(dev, grouped=True)}; {p.mx_mode}) on {len(converted)} GEMM modules: "
            f"{', '.join(p.targets)}")
    if dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp)
    if dims.cp > 1:
        apply_context_parallel(model, meshes.cp, job.cluster.backend)
    layers = model.decoder_layers()  # the MTP layer too (on the last stage)
    apply_activation_checkpointing(layers, job.parallel.activation_checkpoint)
    if job.parallel.compile:
        apply_compile(layers, job.parallel.compile_backend)
    reshard = job.parallel.reshard_after_forward and dims.pp == 1
    ignored = out.expert_params
    if meshes.edp is not None:  # experts: FSDP (HSDP with replicas) over expert-data ranks
        kw = fsdp_kwargs(meshes.edp, job.cluster.param_dtype, job.cluster.reduce_dtype,
                         reshard_after_forward=reshard, cast_forward_inputs=False)
        for moe in model.moe_layers():
            fully_shard(moe.experts, **kw)
        ignored = set()  # the layers' FSDP units skip parameters already sharded inside
    stage_modules = []
    if dims.pp > 1:
        stage_modules = [PipelineStageModule(model, out.splits[s], s == 0,
                                             s == dims.num_stages - 1) for s in out.stages]
        # under PP, layers keep their parameters gathered between micro-batches (trap 1)
        kw = fsdp_kwargs(meshes.dp, job.cluster.param_dtype, job.cluster.reduce_dtype,
                         reshard_after_forward=False, ignored_params=ignored)
        for layer in layers:
            fully_shard(layer, **kw)
        for m in stage_modules:  # the stage root: embedding / output parts, and no-sync control
            fully_shard(m, **kw)
    else:
        apply_fsdp(model, meshes.dp, job.cluster.param_dtype, job.cluster.reduce_dtype,
                   job.parallel.reshard_after_forward, ignored_params=ignored)
    if out.expert_params:  # FSDP replaced the parameter objects
        out.expert_params = expert_parameters(model)
    return out, stage_modules

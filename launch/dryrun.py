"""Dry-run a parallel layout at full size on one CPU process, without GPUs.

    python launch/dryrun.py --world 2048 model=k3 parallel.pp=16 parallel.tp=2 parallel.ep=64 \\
        data.seq_len=4096 data.global_batch=2048 data.micro_batch=1

A fake process group (`backend="fake"`) stands in for `--world` ranks: the job is validated
against that world size, the device meshes are built, and for every pipeline rank the model is
built on the meta device, split into its stages and sharded exactly as training would (expert
parallel, tensor parallel, context parallel, FSDP2). It prints one JSON line per pipeline rank
(its stages, layers and this rank's parameter counts and bytes) and a summary line (with
parallel.cp > 1, also the context-parallel bytes each rank moves per layer and micro-batch:
`context_parallel_mib`). No tensor is allocated.

Bytes per rank (`state_gib`): fp32 master weights + fp32 gradients + AdamW's two fp32 moments
(16 B per local parameter; Muon's matrices keep one momentum: 12 B), plus, under PP or with
`parallel.reshard_after_forward=false` (layers keep their gathered weights between
micro-batches), the gathered compute-dtype weights of the rank's layers
(`gathered_weights_gib`), and, with more than one micro-batch per step, what FSDP2's unsharded
gradient accumulator holds beyond the sharded gradient (`grad_accumulator_gib`: the gathered
parameters less the local ones, in the reduce dtype; with `parallel.fuse_grad_accumulation`, the
default, the fused weights' share of it is kept between steps too). With `optim=muon`: the
matrices that go to owner ranks and the most bytes any data rank sends per step in Muon's two
exchanges (`muon_exchange_gib`, fp32).

Activations (`parallel.activation_memory`, an analytic model checked against fake-tensor
traces) in the cluster's `param_dtype` (bf16 on the GPU clusters; a GPU cluster is accepted
here without a GPU): `activation_gib_per_micro_batch` under each `parallel.activation_checkpoint`
mode, `micro_batches_in_flight` under the pipeline schedule, `activation_working_gib` (the
backward's extra peak, an estimate) and `activation_total_gib` under the job's mode.
`total_gib` = state + gathered weights + gradient accumulator + activations; the summary's
`max_rank_total_gib` is the fullest rank's. `--docs-per-row N` (default 1) sets the documents
per row, which KCP's per-document states scale with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _local_numel(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _tp_local_numel(p) -> int:
    """Elements of `p` once FSDP has gathered it: sharded only by tensor parallelism."""
    mesh = getattr(p, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" not in names or p.placements[names.index("tp")].is_replicate():
        return p.numel()
    return p.numel() // mesh.size(names.index("tp"))


def context_parallel_mib(job, dims) -> dict:
    """Per rank, per layer and micro-batch, forward (the backward moves the same again): KCP's
    all-gather of the fp32 state maps (B x H x K x (K + V) per rank, received from all cp
    ranks) and Ulysses' four all-to-alls (q, k, v in, o out; the (cp - 1) / cp of them that
    leave the rank) in bf16, the GPU activation dtype."""
    m, d = job.model, job.data
    B, L = d.micro_batch, d.seq_len // dims.cp
    kda_heads, D = m.kda_num_heads // dims.tp, m.kda_head_dim
    kcp = dims.cp * B * kda_heads * D * 2 * D * 4
    heads = m.num_attention_heads // dims.tp
    width = 2 * m.qk_head_dim + 2 * m.v_head_dim
    ulysses = B * L * heads * width * 2 * (dims.cp - 1) // dims.cp
    return {"kcp_gather_mib_per_kda_layer": round(kcp / 2**20, 2),
            "ulysses_all_to_all_mib_per_mla_layer_bf16": round(ulysses / 2**20, 2)}


def rank_activations(job, dims, pp_rank: int, stages: list[int], layers: list[int],
                     docs_per_row: int) -> dict:
    """This rank's activation bytes (`parallel.activation_memory`): per micro-batch under each
    checkpointing mode, the micro-batches in flight under the pipeline schedule, and the
    total under the job's mode (in flight x kept + the backward's working peak)."""
    from parallel.activation_memory import Shard, micro_batches_in_flight, stage_memory
    from parallel.fsdp import DTYPES

    d = job.data
    act = DTYPES[job.cluster.param_dtype].itemsize
    shard = Shard(tokens=d.micro_batch * d.seq_len // dims.cp, batch=d.micro_batch,
                  docs=d.micro_batch * docs_per_row, tp=dims.tp, cp=dims.cp, ep=dims.ep,
                  replicas=job.parallel.ep_replicas, act=act)
    first, last = 0 in stages, dims.num_stages - 1 in stages
    per_mode = {ac: stage_memory(job.model, shard, layers, ac, first, last)
                for ac in ("none", "selective", "full")}
    n_micro = d.global_batch // (dims.dp * d.micro_batch)
    flight = micro_batches_in_flight(dims.pp_schedule, dims.pp, pp_rank, n_micro, len(stages))
    mine = per_mode[job.parallel.activation_checkpoint]
    gib = 2**30
    return {
        "activation_gib_per_micro_batch": {ac: round(m.kept / gib, 3)
                                           for ac, m in per_mode.items()},
        "activation_working_gib": round(mine.working / gib, 3),
        "micro_batches_in_flight": flight,
        "activation_total_gib": round((flight * mine.kept + mine.working) / gib, 3),
    }


def describe_rank(job, dims, meshes, pp_rank: int, docs_per_row: int = 1) -> dict:
    from parallel.fsdp import DTYPES, units_stay_gathered
    from parallel.parallelize import shard_on_meta
    from train.config import micro_batches

    out, _ = shard_on_meta(job, dims, meshes, pp_rank, log=lambda m: None)
    expert_ids = {id(p) for p in out.expert_params}
    local_dense = local_expert = gathered_dense = gathered_expert = 0
    muon = job.optim.name == "muon"
    if muon:
        from train.optim.muon import adamw_only
    state_bytes = 0
    for name, p in out.model.named_parameters():
        n = _local_numel(p)
        # fp32 master + fp32 gradient + AdamW's two moments, or Muon's one momentum
        state_bytes += n * (12 if muon and p.requires_grad and not adamw_only(name, p) else 16)
        if id(p) in expert_ids:
            local_expert += n
            gathered_expert += p.numel() // dims.ep  # FSDP over edp gathers the ep shard
        else:
            local_dense += n
            gathered_dense += _tp_local_numel(p)
    compute_bytes = DTYPES[job.cluster.param_dtype].itemsize
    # under PP every layer of the rank stays gathered between micro-batches; experts gathered
    # by FSDP only when ep < dp_shard x tp (else they are never sharded beyond ep)
    fsdp_gathered = gathered_dense + (gathered_expert if dims.edp > 1 else local_expert)
    gathered = (gathered_dense + (gathered_expert if dims.edp > 1 else 0)) * compute_bytes \
        if units_stay_gathered(job.parallel.reshard_after_forward, dims.pp) else 0
    n_micro = micro_batches(job.data, dims.dp)
    accumulator = ((fsdp_gathered - local_dense - local_expert)
                   * DTYPES[job.cluster.reduce_dtype].itemsize if n_micro > 1 else 0)
    local = local_dense + local_expert
    layers = sorted(int(k) for k in out.model.layers.keys())
    extra = {}
    if muon:  # bytes the owner exchanges send per step (fp32 updates)
        from train.optim.muon import exchange_plans

        plans = exchange_plans(out.model)
        extra["muon_exchange_gib"] = round(max(
            (sum(e.exchange_bytes(4, r) for e in plans) for r in range(dims.dp_shard)),
            default=0) / 2**30, 3)
        extra["muon_owner_matrices"] = sum(len(e.shapes) for e in plans)
    extra.update(rank_activations(job, dims, pp_rank, out.stages or [0], layers, docs_per_row))
    extra["total_gib"] = round((state_bytes + gathered + accumulator) / 2**30
                               + extra["activation_total_gib"], 3)
    return {**extra,
        "pp_rank": pp_rank,
        "stages": out.stages or [0],
        "layers": f"{layers[0]}-{layers[-1]}" if layers else "",
        "n_layers": len(layers),
        "local_params": local,
        "local_dense_params": local_dense,
        "local_expert_params": local_expert,
        "state_gib": round(state_bytes / 2**30, 3),
        "state_mib": round(state_bytes / 2**20, 2),
        "gathered_weights_gib": round(gathered / 2**30, 3),
        "grad_accumulator_gib": round(accumulator / 2**30, 3),
        "micro_batches": n_micro,
    }


def main(argv: list[str]) -> int:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launch.pretrain import load_job
    from model.config import ConfigError
    from parallel.dims import ParallelDims

    flags = {"--world": 1, "--docs-per-row": 1}
    for flag in flags:
        if flag in argv:
            i = argv.index(flag)
            try:
                flags[flag] = int(argv[i + 1])
                assert flags[flag] > 0
            except (IndexError, ValueError, AssertionError):
                print(f"error: {flag} takes a positive integer, e.g. {flag} 8", file=sys.stderr)
                return 2
            argv = argv[:i] + argv[i + 2:]
    world, docs = flags["--world"], flags["--docs-per-row"]
    overrides = argv if any(a.startswith("+cluster=") for a in argv) else \
        ["+cluster=local_cpu", *argv]
    try:
        job = load_job(overrides, world, check_device=False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    dims = ParallelDims.from_config(job.parallel, world)
    meshes = dims.build_meshes("cpu")
    rows = [describe_rank(job, dims, meshes, r, docs) for r in range(dims.pp)]
    for row in rows:
        print(json.dumps(row))
    worst = max(rows, key=lambda r: r["state_gib"] + r["gathered_weights_gib"])
    fullest = max(rows, key=lambda r: r["total_gib"])
    print(json.dumps({
        "world": world, "pp": dims.pp, "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "ep": dims.ep,
        "schedule": dims.pp_schedule if dims.pp > 1 else None, "stages": dims.num_stages,
        "max_rank_state_gib": worst["state_gib"],
        "max_rank_gathered_weights_gib": worst["gathered_weights_gib"],
        "max_rank_pp_rank": worst["pp_rank"],
        "activation_checkpoint": job.parallel.activation_checkpoint, "docs_per_row": docs,
        "max_rank_total_gib": fullest["total_gib"], "max_total_pp_rank": fullest["pp_rank"],
        **(context_parallel_mib(job, dims) if dims.cp > 1 else {}),
    }))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The typed config tree of a training job (Hydra structured configs) and its one validation step.

YAML under `configs/` only sets values; every field and its type is declared here. `validate_job`
runs every cross-field check before any process group starts and raises `ConfigError` with one
line naming the field and the fix. Parallel-layout checks are delegated to `parallel.dims`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from model.config import ConfigError, ModelConfig


@dataclass
class RunConfig:
    name: str | None = None  # default: k3-<model preset>
    dir: str | None = None  # default: outputs/<name>


@dataclass
class ClusterConfig:
    name: str = "local_cpu"
    device: str = "cpu"  # cpu | cuda
    backend: str = "gloo"  # gloo | nccl
    # compute dtype of parameters under FSDP: fp32 | bf16; fp64 (CPU) makes the master weights
    # and all compute float64, to prove layouts equal without top-k rounding ties
    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype
    timeout_s: int = 600  # collective timeout: a hung job fails instead of waiting 30 minutes
    peak_tflops: float | None = None  # per device, for MFU; None: look it up from the device


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other dims
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    ep_replicas: bool = True  # MoonEP dynamic expert replicas (every EP rank gets the same load)
    # FSDP: false keeps each unit gathered for the whole step (every micro-batch), one
    # all-gather per unit per step; layers under pp > 1 always keep them gathered
    reshard_after_forward: bool = True
    # with 2+ micro-batches, the weight-gradient GEMMs add into FSDP2's fp32 accumulator
    # themselves (parallel.grad_accumulation) instead of a cast and an add per micro-batch
    fuse_grad_accumulation: bool = True
    # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1  # stages per pp rank (2+ for the interleaved schedules)
    activation_checkpoint: str = "none"  # none | full (per layer) | selective (per op)
    compile: bool = False  # torch.compile each decoder layer
    compile_backend: str = "inductor"


@dataclass
class PrecisionConfig:
    gemm: str = "default"  # default (the cluster's param dtype) | mxfp8
    mx_mode: str = "rceil"  # MX scale rounding: rceil (training default) | floor (OCP MX v1.0)
    wgrad_hp: bool = False  # run the weight-gradient GEMMs unquantised
    # which GEMMs go MXFP8: routed_experts, shared_experts, dense_mlp, attention
    targets: list[str] = field(
        default_factory=lambda: ["routed_experts", "shared_experts", "dense_mlp"])


@dataclass
class DataConfig:
    dataset: str = "stdlib"  # "stdlib" (embedded default corpus) or a prepared data directory
    # "byte", a Hugging Face tokenizer.json, or a folder with one or with K3's tiktoken.model
    tokenizer: str = "byte"
    seq_len: int = 256
    global_batch: int = 16  # sequences per optimizer step, whatever the world size
    micro_batch: int = 4  # sequences per forward/backward on one rank
    seed: int = 1234
    stdlib_max_bytes: int = 20_000_000
    # warn at start when the run reads the training corpus more often than this (epochs)
    max_epochs: float = 4.0
    # shuffle fixed blocks of this many tokens (a multiple of every stage's seq_len) instead of
    # single windows, so a run can resume at another seq_len (data.loader); None: windows
    shuffle_block_tokens: int | None = None


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_frac: float = 0.01  # K3: 1% linear warmup
    min_lr_ratio: float = 0.1
    decay_frac: float = 0.2  # wsd: the last fraction of steps decays linearly
    momentum: float = 0.95  # muon: Nesterov momentum of the Muon side (train.optim.muon)
    nesterov: bool = True
    ns_steps: int = 5  # muon: quintic Newton-Schulz iterations
    # QK-Clip (train.optim.qk_clip): rescale MLA heads whose logit bound exceeds tau after each
    # step; None disables (optim=muon sets 100, K2's value)
    qk_clip_tau: float | None = None


@dataclass
class TrainConfig:
    steps: int = 200
    seed: int = 0
    stop_at_step: int | None = None  # end this run early (with a checkpoint); resume continues
    log_images_every: int = 50
    log_sample_ids: bool = False  # record the global batch's sample ids in metrics.jsonl
    # count host synchronisations per step (train.observe.host_syncs): host_syncs_model (inside the
    # model's forward + backward, 0 without EP) and host_syncs_step (the whole step), by op
    count_host_syncs: bool = False
    # [a, b]: torch.profiler trace of steps a..b (1-based) into <run dir>/profile/
    # (train.observe.profiling)
    profile_steps: list[int] = field(default_factory=list)
    # a step whose loss or gradient norm is not finite on any rank is skipped on all ranks; this
    # many in a row stop the run (its last checkpoint is a good one)
    max_skipped_in_a_row: int = 5
    spike_factor: float = 3.0  # log a loss above this x the running median (0: off)
    # a rank whose compute time (train.observe.stragglers) exceeds this x its peers' median for
    # straggler_steps steps in a row is named in a warning (0: off)
    straggler_factor: float = 1.5
    straggler_steps: int = 5
    # log each MLA head's logit bound (attn_logit_max, one chart per layer) with or without
    # QK-Clip (optim.qk_clip_tau), to watch it grow before choosing a tau; None: on when the
    # model has MLA layers (always on while QK-Clip is)
    track_attn_logits: bool | None = None


@dataclass
class CheckpointConfig:
    enabled: bool = True
    interval: int = 50
    keep: int = 3
    # write in a background thread while training goes on; None: on CUDA only
    async_save: bool | None = None
    resume: bool = True  # resume from the latest complete checkpoint in the run directory
    # a Hugging Face checkpoint folder (K3's release, our export): with no checkpoint in the run
    # directory yet, the model (config.json's, model.FIELD=V on top) starts from its weights, read
    # straight into this layout (train.checkpoint.release_reader), with a fresh optimizer and
    # schedule
    init_from: str | None = None


@dataclass
class EvalConfig:
    """Held-out validation (train.evaluate): the dataset's `val` split (data.prepare
    --val-fraction)."""

    every: int = 0  # steps between validations (and at the run's last step); 0: off
    batches: int = 4  # global batches of the validation split per evaluation


@dataclass
class MetricsConfig:
    wandb_mode: str = "auto"  # auto (online iff a key is configured) | online | offline | disabled
    wandb_project: str = "k3train"
    console: bool = True


@dataclass
class DebugConfig:
    """Test-only fault injection (train.faults.nonfinite)."""

    inject_nonfinite_steps: list[int] = field(default_factory=list)  # NaN loss on the last rank
    # [{step: 3, rank: 1, where: loss | activation | grad}, ...]
    inject_nonfinite: list[Any] = field(default_factory=list)
    slow_rank: int | None = None  # this rank sleeps slow_rank_s in each micro-batch's forward
    slow_rank_s: float = 0.0


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("outputs") / self.run.name


def plain_config(job: JobConfig) -> dict[str, Any]:
    """The resolved config as plain dicts and lists (W&B's config)."""
    return OmegaConf.to_container(OmegaConf.structured(job), resolve=True)  # type: ignore


def save_resolved_config(job: JobConfig, run_dir: Path) -> None:
    """`run_dir/config.yaml`: the resolved config, replaced atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    os.replace(tmp, run_dir / "config.yaml")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def zero_bubble_unsupported(parallel: ParallelConfig, version: tuple[int, int]) -> bool:
    """The zero-bubble schedules split each backward into input and weight parts, and torch <
    2.13 cannot run either part through a Python autograd.Function (ours: the chunked loss, the
    MX GEMMs, the fused ops; "Attribute '_input_metadata' is invalid"), and its ZBV warm-up
    sends to its own rank, which gloo refuses. Measured on 2.11; 2.13 runs both."""
    return parallel.pp > 1 and parallel.pp_schedule in ZERO_BUBBLE and version < (2, 13)


def micro_batches(data: DataConfig, dp: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank (gradient accumulation)."""
    return data.global_batch // (dp * data.micro_batch)


def validate_job(job: JobConfig, world_size: int, check_device: bool = True) -> JobConfig:
    """All cross-field checks; mutates nothing but resolves `parallel.dp_shard=-1`.
    `check_device=False` (the dry run) accepts a CUDA cluster on a machine without one."""
    from parallel.dims import ParallelDims

    job.model.validate()
    c, d, o, t, k = job.cluster, job.data, job.optim, job.train, job.checkpoint
    _need(c.device in ("cpu", "cuda"), f"cluster.device={c.device!r}: use cpu or cuda")
    _need(c.backend in ("gloo", "nccl"), f"cluster.backend={c.backend!r}: use gloo or nccl")
    _need(not (c.device == "cpu" and c.backend == "nccl"),
          "cluster.backend=nccl needs cluster.device=cuda; use gloo on CPU")
    for name in ("param_dtype", "reduce_dtype"):
        v = getattr(c, name)
        _need(v in ("fp32", "bf16", "fp64"), f"cluster.{name}={v!r}: use fp32, bf16 or fp64")
    _need(not (c.device == "cpu" and c.param_dtype == "bf16"),
          "cluster.param_dtype=bf16 on CPU is not supported (slow, see cpu-testing.md); use fp32")
    _need(not (c.device == "cuda" and c.param_dtype == "fp64"),
          "cluster.param_dtype=fp64 is a CPU verification mode; use bf16 or fp32 on cuda")
    if c.device == "cuda" and check_device:
        import torch

        _need(torch.cuda.is_available(),
              "cluster.device=cuda but no CUDA device is visible; use +cluster=local_cpu")
    dims = ParallelDims.from_config(job.parallel, world_size)
    _need(not zero_bubble_unsupported(job.parallel, torch_version()),
          f"parallel.pp_schedule={job.parallel.pp_schedule} needs torch>=2.13 (torch "
          f"{'.'.join(map(str, torch_version()))}'s split backward cannot pass through a Python "
          "autograd.Function); use parallel.pp_schedule=Interleaved1F1B or a newer torch")
    job.parallel.dp_shard = dims.dp_shard
    dp = dims.dp
    dims.validate_model(job.model, seq_len=d.seq_len,
                        microbatches=d.global_batch // max(1, dp * d.micro_batch))
    from parallel.activation_checkpoint import AC_MODES

    _need(job.parallel.activation_checkpoint in AC_MODES,
          f"parallel.activation_checkpoint={job.parallel.activation_checkpoint!r}: choose one "
          f"of {list(AC_MODES)}")
    _need(d.seq_len > 0, f"data.seq_len={d.seq_len} must be positive")
    _need(d.max_epochs > 0, f"data.max_epochs={d.max_epochs} must be > 0")
    _need(d.micro_batch > 0 and d.global_batch > 0, "data.global_batch and data.micro_batch > 0")
    _need(d.global_batch % (dp * d.micro_batch) == 0,
          f"data.global_batch={d.global_batch} must be a multiple of data-parallel size {dp} x "
          f"data.micro_batch={d.micro_batch}; e.g. data.global_batch={dp * d.micro_batch * max(1, d.global_batch // (dp * d.micro_batch))}")  # noqa: E501
    _need(d.dataset == "stdlib" or Path(d.dataset, "manifest.json").is_file(),
          f"data.dataset={d.dataset!r} has no manifest.json; prepare it with "
          "`python -m data.prepare <text files> --output <dir>` or use data.dataset=stdlib")
    from data.tokenizer import tokenizer_path

    _need(d.tokenizer == "byte" or tokenizer_path(d.tokenizer) is not None,
          f"data.tokenizer={d.tokenizer!r} is neither 'byte' nor an existing tokenizer.json or "
          "folder with tokenizer.json or tiktoken.model")
    p = job.precision
    _need(p.gemm in ("default", "mxfp8"), f"precision.gemm={p.gemm!r}: use default or mxfp8")
    _need(p.mx_mode in ("rceil", "floor"), f"precision.mx_mode={p.mx_mode!r}: use rceil or floor")
    known = ("routed_experts", "shared_experts", "dense_mlp", "attention")
    bad = [t for t in p.targets if t not in known]
    _need(not bad, f"precision.targets has {bad}; choose from {list(known)}")
    _need(o.name in ("adamw", "muon"), f"optim.name={o.name!r}: use optim=adamw or optim=muon")
    _need(0 <= o.momentum < 1, f"optim.momentum={o.momentum} must be in [0, 1)")
    _need(o.ns_steps > 0, f"optim.ns_steps={o.ns_steps} must be > 0")
    _need(o.qk_clip_tau is None or o.qk_clip_tau > 0,
          f"optim.qk_clip_tau={o.qk_clip_tau} must be > 0, or null to disable QK-Clip")
    _need(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
          f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    _need(o.schedule in ("cosine", "wsd", "constant"),
          f"optim.schedule={o.schedule!r}: use cosine, wsd or constant")
    _need(0 <= o.warmup_frac < 1, f"optim.warmup_frac={o.warmup_frac} must be in [0, 1)")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _need(0 < o.decay_frac <= 1, f"optim.decay_frac={o.decay_frac} must be in (0, 1]")
    _need(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables)")
    _need(t.steps > 0, f"train.steps={t.steps} must be > 0")
    ps = list(t.profile_steps or [])
    _need(not ps or (len(ps) == 2 and all(isinstance(v, int) for v in ps)
                     and 1 <= ps[0] <= ps[1] <= t.steps),
          f"train.profile_steps={ps} must be [first, last] with 1 <= first <= last <= "
          f"train.steps={t.steps}, e.g. train.profile_steps=[3,4]")
    _need(t.stop_at_step is None or 0 < t.stop_at_step <= t.steps,
          f"train.stop_at_step={t.stop_at_step} must be in 1..train.steps={t.steps}")
    _need(t.max_skipped_in_a_row > 0,
          f"train.max_skipped_in_a_row={t.max_skipped_in_a_row} must be > 0")
    _need(t.spike_factor == 0 or t.spike_factor > 1,
          f"train.spike_factor={t.spike_factor} must be > 1, or 0 to turn spike logging off")
    _need(t.straggler_factor == 0 or t.straggler_factor > 1,
          f"train.straggler_factor={t.straggler_factor} must be > 1, or 0 to turn it off")
    _need(t.straggler_steps > 0, f"train.straggler_steps={t.straggler_steps} must be > 0")
    e = job.eval
    _need(e.every >= 0, f"eval.every={e.every} must be >= 0 (0: no validation)")
    _need(e.batches > 0, f"eval.batches={e.batches} must be > 0")
    g = job.debug
    _need(g.slow_rank is None or 0 <= g.slow_rank < world_size,
          f"debug.slow_rank={g.slow_rank} must be a rank in 0..{world_size - 1}, or null")
    _need(g.slow_rank_s >= 0, f"debug.slow_rank_s={g.slow_rank_s} must be >= 0")
    from train.faults.nonfinite import check_injections

    _need(*check_injections(job.debug, world_size))
    _need(k.interval > 0, f"checkpoint.interval={k.interval} must be > 0")
    _need(k.keep > 0, f"checkpoint.keep={k.keep} must be > 0 (the latest is always kept)")
    _need(job.metrics.wandb_mode in ("auto", "online", "offline", "disabled"),
          f"metrics.wandb_mode={job.metrics.wandb_mode!r}: use auto, online, offline or disabled")
    rd = job.run_dir
    _need(not rd.exists() or rd.is_dir(), f"run.dir={str(rd)!r} exists and is not a directory")
    parent = rd.resolve().parent
    while not parent.exists():
        parent = parent.parent
    _need(parent.is_dir(), f"run.dir={str(rd)!r}: {str(parent)!r} is not a directory; "
          "choose another run.dir")
    _need(os.access(parent, os.W_OK), f"run.dir={str(rd)!r} is not writable; choose another")
    return job

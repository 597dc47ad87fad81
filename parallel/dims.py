"""ParallelDims: the parallel layout of a job, validated against the world size and the model.

Dense mesh dims follow torchtitan's order `[pp, dp_replicate, dp_shard, cp, tp]`. Data
parallelism is FSDP2 over dp_shard x cp (HSDP when dp_replicate > 1): the cp ranks of a
group hold other slices of the same rows (`parallel.context_parallel`), so to FSDP they are
data ranks too; tensor parallelism shards heads and MLP columns with sequence
parallelism between them (`parallel.tensor_parallel`); pipeline parallelism splits the layers
into stages (`parallel.pipeline`); expert parallelism splits the dp_shard x tp ranks into (edp, ep):
routed experts are sharded over the ep ranks (MoonEP dispatch) and by FSDP over the edp ranks
(dp_shard x cp x tp = edp x ep),
on an expert mesh `[pp, dp_replicate, edp, ep]` over the same ranks; with dp_replicate > 1 the
experts' FSDP is HSDP over (dp_replicate, edp), so replica groups all-reduce expert gradients.
EP borrows the cp and tp ranks (Megatron's expert-tensor-parallel size 1): in the sequence-
parallel region every tp rank routes its own tokens, as every cp rank routes its own slice, so
they are as good as data-parallel ranks to the experts, and no expert is replicated over them.
Every check is a one-line error naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ConfigError, ModelConfig

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                         "ZBVZeroBubble")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    cp: int
    world_size: int
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1

    @classmethod
    def from_config(cls, pc, world_size: int) -> ParallelDims:
        for name in ("dp_replicate", "tp", "pp", "ep", "cp"):
            v = getattr(pc, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"parallel.{name}={v!r} must be a positive integer")
        other = pc.dp_replicate * pc.tp * pc.pp * pc.cp
        dp_shard = pc.dp_shard
        if dp_shard == -1:
            if world_size % other:
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate="
                    f"{pc.dp_replicate} x parallel.tp={pc.tp} x parallel.pp={pc.pp} x "
                    f"parallel.cp={pc.cp} = {other}; change those or the number of processes")
            dp_shard = world_size // other
        if dp_shard < 1 or other * dp_shard != world_size:
            raise ConfigError(
                f"parallel dims dp_replicate={pc.dp_replicate} x dp_shard={dp_shard} x tp={pc.tp} "
                f"x pp={pc.pp} x cp={pc.cp} = {other * dp_shard} != world size {world_size}; "
                "set parallel.dp_shard=-1 to derive it")
        schedule = getattr(pc, "pp_schedule", "1F1B")
        virtual = getattr(pc, "pp_virtual_stages", 1)
        dims = cls(pc.dp_replicate, dp_shard, pc.tp, pc.pp, pc.ep, pc.cp, world_size,
                   schedule, virtual)
        if schedule not in SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={schedule!r}: choose one of {list(SCHEDULES)}")
        if not isinstance(virtual, int) or virtual < 1:
            raise ConfigError(f"parallel.pp_virtual_stages={virtual!r} must be a positive integer")
        multi = schedule in MULTI_STAGE_SCHEDULES
        if dims.pp > 1 and multi and virtual < 2:
            raise ConfigError(f"parallel.pp_schedule={schedule} runs several stages per rank; "
                              "set parallel.pp_virtual_stages=2 (or more)")
        if dims.pp > 1 and not multi and virtual != 1:
            raise ConfigError(f"parallel.pp_schedule={schedule} runs one stage per rank; use "
                              "parallel.pp_virtual_stages=1 or an interleaved schedule")
        if schedule == "ZBVZeroBubble" and dims.pp > 1 and virtual != 2:
            raise ConfigError("parallel.pp_schedule=ZBVZeroBubble needs "
                              "parallel.pp_virtual_stages=2 (the V shape)")
        expert_ranks = dims.dp_shard * dims.cp * dims.tp
        if dims.ep > 1 and expert_ranks % dims.ep:
            raise ConfigError(
                f"parallel.ep={dims.ep} must divide parallel.dp_shard x parallel.cp x "
                f"parallel.tp = {dims.dp_shard} x {dims.cp} x {dims.tp} = {expert_ranks} "
                f"(experts are sharded over ep "
                f"ranks and by FSDP over the other {expert_ranks} / ep, inside each of the "
                f"dp_replicate groups); use a divisor of {expert_ranks} or parallel.ep=1")
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks holding the same experts (FSDP shards them)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def loss_scale_ranks(self) -> int:
        """FSDP's averaging degree, which the loss is pre-multiplied by: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_grad_divisor(self) -> float:
        """What is left of the loss factor on expert gradients after FSDP averaged them over
        dp_replicate x edp (HSDP; neither when both are 1): the loss is pre-multiplied by
        dp_replicate x dp_shard x cp, so dp_shard x cp / edp (= ep / tp)."""
        return self.dp_shard * self.cp / self.edp

    @property
    def num_stages(self) -> int:
        return self.pp * (self.pp_virtual_stages if self.pp > 1 else 1)

    @property
    def expert_parallel(self) -> bool:
        return self.ep > 1

    def validate_model(self, cfg: ModelConfig, seq_len: int | None = None,
                       microbatches: int | None = None) -> None:
        """Layout-vs-model checks, one-line errors (heads vs tp, layers vs pp, experts vs ep)."""
        for heads, field_name in ((cfg.kda_num_heads, "kda_num_heads"),
                                  (cfg.num_attention_heads, "num_attention_heads")):
            if heads % self.tp:
                raise ConfigError(f"parallel.tp={self.tp} does not divide model.{field_name}="
                                  f"{heads}; use a divisor of {heads}")
        for width, field_name in ((cfg.intermediate_size, "intermediate_size"),
                                  (cfg.num_shared_experts * cfg.moe_intermediate_size,
                                   "num_shared_experts x moe_intermediate_size")):
            if width and width % self.tp:
                raise ConfigError(f"parallel.tp={self.tp} does not divide model.{field_name}="
                                  f"{width}; use a divisor")
        if cfg.vocab_size % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} does not divide model.vocab_size="
                              f"{cfg.vocab_size} (vocabulary-parallel head); pad the vocabulary")
        if seq_len is not None and seq_len % (self.cp * self.tp):
            raise ConfigError(f"data.seq_len={seq_len} is not divisible by parallel.cp x "
                              f"parallel.tp = {self.cp * self.tp} (context and sequence "
                              "parallelism split each row); use a multiple")
        if self.cp > 1:
            heads = cfg.num_attention_heads // self.tp
            if heads % self.cp:
                raise ConfigError(
                    f"parallel.cp={self.cp} does not divide the {heads} MLA heads per tp rank "
                    f"(model.num_attention_heads={cfg.num_attention_heads} / parallel.tp="
                    f"{self.tp}): Ulysses attention splits them over cp; use a divisor")
            if seq_len is not None and seq_len // self.cp < cfg.short_conv_kernel_size - 1:
                raise ConfigError(
                    f"data.seq_len={seq_len} / parallel.cp={self.cp} is shorter than the short "
                    f"convolution's halo (model.short_conv_kernel_size - 1 = "
                    f"{cfg.short_conv_kernel_size - 1}); use a smaller parallel.cp")
        if cfg.num_hidden_layers < self.num_stages:
            raise ConfigError(f"parallel.pp={self.pp} x pp_virtual_stages="
                              f"{self.pp_virtual_stages} = {self.num_stages} stages exceeds "
                              f"model.num_hidden_layers={cfg.num_hidden_layers}")
        if self.pp > 1 and microbatches is not None and microbatches < self.pp:
            raise ConfigError(f"{microbatches} micro-batches per step < parallel.pp={self.pp} "
                              "pipeline stages; lower data.micro_batch or raise "
                              "data.global_batch")
        if cfg.num_experts % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide model.num_experts="
                              f"{cfg.num_experts}; use a divisor of {cfg.num_experts}")

    def build_meshes(self, device_type: str) -> Meshes:
        """The world mesh [pp, dp_replicate, dp_shard, cp, tp] and its named slices."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type,
                                 (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                 mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        shard = "dp_shard"
        if self.cp > 1:  # FSDP shards over the cp ranks too
            world["dp_shard", "cp"]._flatten("dp_shard_cp")
            shard = "dp_shard_cp"
        dp = world["dp_replicate", shard] if self.dp_replicate > 1 else world[shard]
        dp_flat = world["dp_replicate", "dp_shard"]._flatten("dp")
        batch = world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")
        dp_rank = dp_flat.get_local_rank()
        meshes = Meshes(world=world, dp=dp, tp=world["tp"] if self.tp > 1 else None,
                        pp=world["pp"] if self.pp > 1 else None, ep=None,
                        dp_group=dp_flat.get_group(), batch_group=batch.get_group(),
                        dp_rank=dp_rank, pp_rank=world.get_local_rank("pp"),
                        cp=world["cp"] if self.cp > 1 else None)
        if self.ep > 1:  # the same ranks in the same order, dp_shard x cp x tp split into
            # (edp, ep)
            experts = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.edp,
                                                     self.ep),
                                       mesh_dim_names=("pp", "dp_replicate", "edp", "ep"))
            meshes.ep = experts["ep"]
            if self.dp_replicate > 1:  # HSDP of the experts: replicas all-reduce their grads
                meshes.edp = experts["dp_replicate", "edp"]
            elif self.edp > 1:
                meshes.edp = experts["edp"]
        return meshes


@dataclass
class Meshes:
    """`dp`: FSDP's mesh (1-D, or 2-D for HSDP; over dp_shard x cp). `dp_group`: ranks that see
    different samples (token counts, sample ids). `batch_group`: every rank that holds the same
    layers but other tokens (dp x cp x tp under context and sequence parallelism): loss sums
    and Quantile-Balancing statistics. `cp`: the context-parallel mesh (None when cp is 1)."""

    world: object
    dp: object
    tp: object | None
    pp: object | None
    ep: object | None
    dp_group: object
    batch_group: object
    dp_rank: int
    pp_rank: int
    edp: object | None = None  # FSDP mesh of the routed experts: edp, or (dp_replicate, edp)
    cp: object | None = None

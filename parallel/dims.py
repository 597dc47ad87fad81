"""ParallelDims: the parallel layout of a job, validated against the world size and the model.

Dense mesh dims follow torchtitan's order `[pp, dp_replicate, dp_shard, cp, tp]`. This version
implements data parallelism (FSDP2 over dp_shard, HSDP when dp_replicate > 1) and expert
parallelism over the same ranks (ep = dp_shard: each rank owns E/ep experts, MoonEP dispatch);
tp, pp and cp are validated as layout numbers and rejected with a one-line error until they are
implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ConfigError, ModelConfig

IMPLEMENTED = {"tp": 1, "pp": 1, "cp": 1}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    cp: int
    world_size: int

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
        dims = cls(pc.dp_replicate, dp_shard, pc.tp, pc.pp, pc.ep, pc.cp, world_size)
        for name, supported in IMPLEMENTED.items():
            if getattr(dims, name) != supported:
                raise ConfigError(f"parallel.{name}={getattr(dims, name)} is not implemented yet "
                                  f"(data and expert parallelism only for now); use "
                                  f"parallel.{name}=1")
        if dims.ep > 1 and (dims.ep != dims.dp_shard or dims.dp_replicate != 1):
            raise ConfigError(
                f"parallel.ep={dims.ep} must equal parallel.dp_shard={dims.dp_shard} with "
                f"dp_replicate=1 for now (experts sharded over all data ranks); use "
                f"parallel.ep={dims.dp_shard} or parallel.ep=1")
        return dims

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    def validate_model(self, cfg: ModelConfig) -> None:
        """Layout-vs-model checks, one-line errors (heads vs tp, layers vs pp, experts vs ep)."""
        for heads, field_name in ((cfg.kda_num_heads, "kda_num_heads"),
                                  (cfg.num_attention_heads, "num_attention_heads")):
            if heads % self.tp:
                raise ConfigError(f"parallel.tp={self.tp} does not divide model.{field_name}="
                                  f"{heads}; use a divisor of {heads}")
        if cfg.num_hidden_layers < self.pp:
            raise ConfigError(f"parallel.pp={self.pp} exceeds model.num_hidden_layers="
                              f"{cfg.num_hidden_layers}")
        if cfg.num_experts % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide model.num_experts="
                              f"{cfg.num_experts}; use a divisor of {cfg.num_experts}")

    @property
    def expert_parallel(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str):
        """The data-parallel DeviceMesh: 1-D [dp_shard], or 2-D [dp_replicate, dp_shard] (HSDP)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.dp_replicate > 1:
            return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))

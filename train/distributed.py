"""Process-group lifecycle under torchrun (or a single plain process).

Init with a timeout so a hung collective fails in minutes, not gloo's default 30; shut down with
barrier -> destroy -> flush -> os._exit, which avoids the SIGABRT some DTensor runs hit at
interpreter exit (cpu-testing.md trap 3).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _attempt_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store prefixed with the restart count: the agent keeps
    one store (and port) across restarts, and gloo's mesh set-up would otherwise read the
    dead workers' addresses of the previous attempt ("Connection refused" on every restart).
    None elsewhere (init_process_group's own env:// store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"k3train/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                            store)


def init_distributed(device_type: str, backend: str, timeout_s: int) -> DistEnv:
    rank = int(os.environ.get("RANK", "0"))
    world = world_size_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a plain `python launch/pretrain.py`: world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device_type == "cuda" else None,
                                store=_attempt_store(world, timeout))
    return DistEnv(rank, world, local_rank, device)


def shutdown(exit_code: int = 0) -> None:
    """Leave cleanly: every rank reaches the barrier, then exits without interpreter teardown."""
    if dist.is_initialized():
        try:
            if exit_code == 0:
                dist.barrier()
            dist.destroy_process_group()
        except Exception:  # a failing run must still exit with its own code
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

"""Spawn gloo ranks from pytest (torch.multiprocessing) with a timeout and a clean exit.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in fresh processes; an
exception in any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown (cpu-testing.md trap 3)


def run_ranks(fn, world_size: int, *args) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            failures.append((-1, "rank timed out"))
    if failures or any(p.exitcode != 0 for p in procs):
        msg = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(failures))
        raise AssertionError(f"distributed test failed:\n{msg or [p.exitcode for p in procs]}")

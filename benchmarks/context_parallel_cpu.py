"""Step time of context parallelism on CPU: the `debug` preset's forward+backward over the same
packed tokens on one rank and split over cp ranks (gloo, one thread per rank); prints one JSON
line.

    python benchmarks/context_parallel_cpu.py [--seq 2048] [--docs 5] [--cp 2] [--repeats 5]

Each rank of cp holds seq / cp tokens and exchanges KCP's state maps, the conv halos and
Ulysses' all-to-alls (DeepSpeed's `DistributedAttention`). `overhead` = cp x (the cp run's best
step) / (one rank's best step): the compute and communication the split adds per token (1.0 =
none; the wall-clock speed-up is cp / overhead when each rank has its own core).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _bounds(seq: int, docs: int) -> torch.Tensor:
    """Uneven documents that start inside shards and cross their edges."""
    cuts = [round(seq * (i / docs) ** 0.8) + 3 for i in range(1, docs)]
    return torch.tensor([0, *cuts, seq], dtype=torch.int32)


def _run(rank: int, world: int, port: int, args, out) -> None:
    from kda_cpu import best_ms  # (benchmarks/ is this script's sys.path[0])

    from model.build import build_model
    from model.packing import shard_window

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_model("debug", seed=0)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from parallel.context_parallel import apply_context_parallel

        apply_context_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
                               "gloo")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    if world > 1:
        labels = shard_window(labels, rank, world)
    cu = _bounds(args.seq, args.docs)

    def step() -> None:
        packing = model.packing(ids, cu)
        s, n = model(ids, packing, labels=labels)
        s.backward()
        if world > 1:
            dist.barrier()

    best = best_ms(step, args.repeats) / 1e3  # after one warm-up step
    if rank == 0:
        out.put(best)
    if world > 1:
        dist.destroy_process_group()


def _best_step(world: int, args) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(world, port, args, out), nprocs=world, start_method="spawn")
    return out.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    one, split = _best_step(1, args), _best_step(args.cp, args)
    print(json.dumps({"benchmark": "context_parallel_cpu", "model": "debug", "seq": args.seq,
                      "docs": args.docs, "cp": args.cp, "one_rank_s": round(one, 3),
                      "cp_s": round(split, 3),
                      "overhead": round(args.cp * split / one, 3)}))


if __name__ == "__main__":
    main()

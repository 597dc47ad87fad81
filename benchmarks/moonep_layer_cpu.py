"""One MoonEP MoE layer on gloo CPU ranks: host reads and collectives per layer; one JSON line.

    python benchmarks/moonep_layer_cpu.py --ranks 4

What: every rank routes `--tokens` tokens to `--topk` of `--experts` experts (a skewed router:
one hot expert, so replicas are planned), then runs dispatch -> replica weight fetch -> grouped
SiTU-GLU experts (bf16 weights and tokens) -> combine, forward and backward, as a training step
does. Counted on every rank (`train.observe.host_syncs.HostSyncCounter` around the forward and
around the backward; wrappers on the `torch.distributed` collectives):
* host_reads_forward / host_reads_backward (the worst rank) and rank 0's by name: where a GPU
  would wait for the host;
* collectives_forward / collectives_backward: rank 0's sequence of collectives, each with its
  payload bytes summed over all ranks;
* route_ops: aten ops (views excluded; about one kernel each on a GPU) of one `route` call, of
  which route_planner_ops are the device planner's torch backend (on CUDA its Triton backend
  is 47 ops: `moonep.device_planner.planner_launches`).
Counts do not depend on the shape (bytes do; `python -m moonep.simulate` gives K3-shape bytes).
The dispatcher's API is the one `model.moe` uses (dispatch, gather_expert_weights, combine), so
the script also measures older moonep versions (PYTHONPATH to their checkout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _layer(rank: int, args: argparse.Namespace, out_q) -> None:
    from model.ops.grouped_gemm import grouped_mm
    from model.ops.situ import situ_glu
    from moonep import MoonEPDispatcher
    from train.observe.host_syncs import HostSyncCounter

    R, E, S, k, L, M = args.ranks, args.experts, args.tokens, args.topk, args.latent, args.inter
    g = torch.Generator().manual_seed(rank)
    scores = torch.rand(S, E, generator=g)
    scores[:, 0] = 2.0  # one hot expert: every token's first choice -> replicas
    idx = scores.topk(k).indices
    wts = torch.rand(S, k, generator=g)
    x = torch.randn(S, L, generator=g, dtype=torch.bfloat16).requires_grad_()
    epn = E // R
    ws = [(torch.randn(epn, *shape, generator=g) * 0.1).to(torch.bfloat16).requires_grad_()
          for shape in ((M, L), (M, L), (L, M))]
    disp = MoonEPDispatcher(None, E, replicas=True, pad_multiple=args.pad)

    ops = _OpCount()
    if hasattr(disp, "route"):  # the device-side work of one route (this machine: torch backend)
        with ops:
            disp.route(idx)
    calls: list[dict] = []

    def wrap(name):
        real = getattr(dist, name)

        def fn(*a, **kw):
            t = a[1]
            calls.append({"op": name, "bytes": t.numel() * t.element_size()})
            return real(*a, **kw)
        return real, fn

    saved = {}
    for name in ("all_to_all_single", "all_gather", "all_gather_into_tensor",
                 "all_gather_single"):
        if hasattr(dist, name):
            saved[name], fn = wrap(name)
            setattr(dist, name, fn)
    try:
        with HostSyncCounter() as fwd:
            xg, sizes, handle = disp.dispatch(x, idx, wts)
            w1, w3, w2 = disp.gather_expert_weights(handle, *ws)
            h = situ_glu(grouped_mm(xg, w1, sizes), grouped_mm(xg, w3, sizes))
            y = disp.combine(grouped_mm(h, w2, sizes), handle)
        coll_fwd = list(calls)
        calls.clear()
        with HostSyncCounter() as bwd:
            y.sum().backward()
        coll_bwd = list(calls)
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
    out_q.put((rank, {"fwd": dict(fwd.counts), "bwd": dict(bwd.counts), "route_ops": ops.n},
               coll_fwd, coll_bwd))


class _OpCount(TorchDispatchMode):
    """aten ops dispatched (views excluded): on a GPU, about one kernel launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _entry(rank: int, args: argparse.Namespace, port: int, out_q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=120))
    try:
        _layer(rank, args, out_q)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="per rank")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--pad", type=int, default=1)
    args = ap.parse_args()
    if args.experts % args.ranks:
        ap.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    mp.start_processes(_entry, args=(args, port, out_q), nprocs=args.ranks, join=True,
                       start_method="spawn")
    per_rank = sorted(out_q.get(timeout=10) for _ in range(args.ranks))
    result = {"ranks": args.ranks, "experts": args.experts, "tokens_per_rank": args.tokens,
              "topk": args.topk}
    result["route_ops"] = per_rank[0][1]["route_ops"]
    if result["route_ops"]:
        from moonep.device_planner import planner_launches

        counts = torch.randint(0, 9, (args.ranks, args.experts))
        result["route_planner_ops"] = planner_launches(counts, args.ranks, backend="torch")
    for i, phase in enumerate(("forward", "backward")):
        reads = [r[1]["fwd" if i == 0 else "bwd"] for r in per_rank]
        result[f"host_reads_{phase}"] = max(sum(c.values()) for c in reads)  # the worst rank
        result[f"host_reads_{phase}_by_op"] = reads[0]
        calls = [r[2 + i] for r in per_rank]
        result[f"collectives_{phase}"] = [  # rank 0's sequence, bytes summed over ranks
            {"op": c["op"], "bytes_all_ranks": sum(rc[j]["bytes"] for rc in calls)}
            for j, c in enumerate(calls[0])]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Context parallelism: every row's sequence split into `cp` contiguous shards over the cp mesh.

Rank r of the cp group holds tokens [r T / cp, (r + 1) T / cp) of every row of the micro-batch
(`Packing.shard`: the model windows whole-row token ids itself, the trainer windows the labels).
Everything per token (norms, AttnRes mixes, router, experts, head) runs on the shard as is; the
three ops that look along the sequence exchange what they need over cp:

- KDA (KCP, `model.ops.kda_context`): each rank computes its shard's affine state map (M, S~)
  per row and head from a zero state, one all-gather shares them (B x H x K x (K + V) values
  per rank and layer, whatever the length), each rank composes the maps of the ranks before it
  (cut at document starts) into its true entering state, and adds that state's effect to
  the same pass's output (exact: the widened pass also carries each token's M_t). The
  all-gather's backward (a reduce-scatter) returns the entering state's gradient to the ranks
  whose maps made it.
- The short convolutions: the previous rank's last (kernel - 1) inputs, from one all-gather of
  every rank's tail (ignored where a document starts at the shard's first token: the conv's
  document mask drops those taps).
- Gated MLA (DeepSpeed-Ulysses): DeepSpeed's `DistributedAttention` all-to-alls q, k, v from
  sequence shards to head shards, our varlen attention runs on the whole rows for H / cp heads
  (documents intact, `ContextShard.full`), and a second all-to-all returns the output to
  sequence shards. QK-Clip's per-head logit bounds are gathered back to all heads. Where
  DeepSpeed cannot start, the same layout runs on our own all-to-all (`own_ulysses`).

FSDP shards parameters over dp_shard x cp and averages gradients over it (the trainer scales
the loss by dp x cp), Quantile-Balancing statistics and loss sums include the cp ranks
(`Meshes.batch_group`), and EP may borrow cp ranks like tp ranks (`parallel.dims`).
"""

from __future__ import annotations

import torch
from torch import nn

from model.decoder import K3Model
from model.kda import KimiDeltaAttention
from model.mla import GatedMLA
from model.ops.attention import packed_causal_attention
from model.ops.kda_context import corrected_output, fragment_pass, incoming_states
from model.packing import Packing
from model.short_conv import ShortConv
from parallel.collectives import all_gather


def apply_context_parallel(model: K3Model, cp_mesh, backend: str) -> None:
    """Make `model` (any device, before FSDP) compute its rank's shard of every row."""
    group = cp_mesh.get_group()
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    model.context_shard = (rank, size)
    attention = ulysses_attention(group, size, backend)
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.kda_op = kcp_kda(group, rank, size)
        elif isinstance(module, ShortConv):
            _halo_conv(module, group, rank, size)
        elif isinstance(module, GatedMLA):
            module.attention = attention


def kcp_kda(group, rank: int, size: int):
    """`KimiDeltaAttention.kda_op` for shard `rank` of `size` (module docstring)."""

    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
           packing: Packing, gate, chunk_size: int) -> torch.Tensor:
        ctx = packing.context
        B, L, H, K = q.shape
        V = v.shape[-1]
        flat = [t.reshape(1, B * L, *t.shape[2:]) for t in (q, k, v, f, b)]
        where = (packing.cu_seqlens, ctx.first_doc, ctx.carry)
        M, S, o_wide = fragment_pass(*flat, *where, ctx.last_doc, chunk_size, gate,
                                     packing.cu_seqlens_cpu)
        maps = all_gather(torch.cat([M, S], dim=-1).contiguous(), 0, group)
        maps = maps.view(size, B, H, K, K + V)
        state = incoming_states(maps[..., :K], maps[..., K:], rank)
        return corrected_output(o_wide, state).view(B, L, H, V)

    return op


def _halo_conv(module: ShortConv, group, rank: int, size: int) -> None:
    """Prepend the previous shard's last (kernel - 1) inputs, convolve, drop them again."""
    halo = module.kernel_size - 1
    inner = module.forward

    def forward(x: torch.Tensor, pos_in_doc: torch.Tensor) -> torch.Tensor:
        if halo == 0:
            return inner(x, pos_in_doc)
        B, L, C = x.shape
        tails = all_gather(x[:, L - halo:].contiguous(), 0, group).view(size, B, halo, C)
        # rank 0 uses a zero halo, still taken from the gathered tails: every rank's backward
        # then runs the gather's collective
        prev = tails[rank - 1] if rank > 0 else 0.0 * tails[size - 1]
        pos = torch.cat([pos_in_doc.new_zeros(B, halo), pos_in_doc], dim=1)
        return inner(torch.cat([prev, x], dim=1), pos)[:, halo:]

    module.forward = forward


class _LocalAttention(nn.Module):
    """What Ulysses runs on each rank's heads over the whole rows: our packed attention, with
    the per-head logit bounds (QK-Clip) handed out through `bounds`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                scale: float, bounds: list | None) -> torch.Tensor:
        if bounds is None:
            return packed_causal_attention(q, k, v, packing, scale)
        o, bound = packed_causal_attention(q, k, v, packing, scale, logit_bound=True)
        bounds.append(bound)
        return o


def ulysses_attention(group, size: int, backend: str):
    """`GatedMLA.attention` over DeepSpeed-Ulysses' `DistributedAttention` on the cp group
    ([B, L, H, D] tensors: batch dim 0, heads scattered, sequence gathered). If DeepSpeed cannot
    start here, the same layout runs on our own `all_to_all_single` (`own_ulysses`) and the
    reason is printed."""
    try:
        from deepspeed.sequence.layer import DistributedAttention

        _init_deepspeed(backend)
        run = DistributedAttention(_LocalAttention(), group, scatter_idx=2, gather_idx=1)
        ulysses = lambda q, k, v, *args: run(q, k, v, 0, None, *args)  # batch dim 0, no rotary
    except Exception as e:  # noqa: BLE001 (any failure of the optional backend)
        print(f"context parallel: DeepSpeed-Ulysses unavailable ({type(e).__name__}: "
              f"{' '.join(str(e).split())[:200]}); using our own all-to-all", flush=True)
        ulysses = own_ulysses(group, size)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                  scale: float, logit_bound: bool = False):
        bounds: list | None = [] if logit_bound else None
        o = ulysses(q, k, v, packing.context.full, scale, bounds)
        if not logit_bound:
            return o
        return o, all_gather(bounds[0].contiguous(), 0, group).detach()  # every head's bound

    return attention


def _init_deepspeed(backend: str) -> None:
    """`deepspeed.comm` over the process group torch already has. On CPU, DeepSpeed's backend
    JIT-compiles a shared-memory all-reduce op when it starts (about a minute, and it needs a
    C++ compiler) that Ulysses never calls: marking the op unavailable in DeepSpeed's op table
    (kept per process, edits persist) skips the build."""
    import deepspeed
    import deepspeed.comm
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if deepspeed.comm.is_initialized():
        return
    if get_accelerator().device_name() == "cpu":
        vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def own_ulysses(group, size: int):
    """DeepSpeed-Ulysses' layout on `all_to_all_single` (autograd-aware): sequence shards
    [B, L, H, D] -> whole rows of H / size heads [B, size L, H / size, D], attention, back."""
    import torch.distributed._functional_collectives as funcol

    local = _LocalAttention()

    def exchange(x: torch.Tensor) -> torch.Tensor:  # [size, ...] chunk j -> rank j
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group).view_as(x)

    def to_heads(x: torch.Tensor) -> torch.Tensor:
        B, L, H, D = x.shape
        y = exchange(x.view(B, L, size, H // size, D).permute(2, 0, 1, 3, 4))
        return y.permute(1, 0, 2, 3, 4).reshape(B, size * L, H // size, D)  # rank-major rows

    def to_sequence(x: torch.Tensor) -> torch.Tensor:
        B, T, h, D = x.shape
        y = exchange(x.view(B, size, T // size, h, D).permute(1, 0, 2, 3, 4))
        return y.permute(1, 2, 0, 3, 4).reshape(B, T // size, size * h, D)

    def run(q, k, v, packing, scale, bounds):
        return to_sequence(local(to_heads(q), to_heads(k), to_heads(v), packing, scale, bounds))

    return run

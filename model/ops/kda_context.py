"""KDA across context-parallel shards (KCP, k3-architecture.md §1.8): the maths, no communication.

A shard of a row acts on the state entering it as an affine map S_out = M S_in + S~ (per head,
M [K, K], S~ [K, V]). Its (M, S~) comes from one pass of the shard's own tokens from a zero
state, with v widened to [v | 0_K] and the document that enters the shard started from [0 | I]:
the recurrence is linear in (S_0, v), so the final state of the shard's last document is
[S~ | M], and M = 0 wherever a document starts inside the shard or at its first token (the
chain is cut there). `fragment_maps` computes it, `incoming_states` composes the maps of the
shards before this one (gathered by the caller: `parallel.context_parallel`), and
`kda_from_incoming` runs the shard again with its true entering state, so the output is exact
(not corrected). All three are differentiable, so the state's gradient flows back to earlier
shards through whatever gathered their maps. Payload per shard: B x H x K x (K + V) values,
whatever the length. Shapes only: no host reads.
"""

from __future__ import annotations

import torch

from model.ops.kda import KDAGate, chunk_kda

Tensor = torch.Tensor


def _entering(state: Tensor, first_doc: Tensor, carry: Tensor, n_docs: int) -> Tensor:
    """Per-document initial states [N, H, K, V]: `state` [B, H, K, V] for each row's entering
    document where it continues (`carry`), zeros elsewhere."""
    keep = state * carry.to(state.dtype).view(-1, 1, 1, 1)
    return keep.new_zeros(n_docs, *state.shape[1:]).index_copy(0, first_doc, keep)


def fragment_maps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                  first_doc: Tensor, carry: Tensor, last_doc: Tensor, chunk_size: int,
                  gate: KDAGate | None = None, cu_seqlens_cpu: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """(M [B, H, K, K], S~ [B, H, K, V]) of each row's shard: the state leaving it is
    M @ S_in + S~ for the state S_in entering it. Inputs as `chunk_kda`'s varlen form
    ([1, B*L, ...] with the shard's `cu_seqlens`); `first_doc`, `carry`, `last_doc` [B] as in
    `model.packing.ContextShard`."""
    H, K = q.shape[2], q.shape[3]
    B = first_doc.shape[0]
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)  # [1, BL, H, V + K]
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=dtype, device=v.device)
    init = torch.cat([torch.zeros(B, H, K, v.shape[-1], dtype=dtype, device=v.device),
                      eye.expand(B, H, K, K)], dim=-1)
    n_docs = cu_seqlens.numel() - 1
    _, final = chunk_kda(q, k, wide, g, beta, initial_state=_entering(init, first_doc, carry,
                                                                      n_docs),
                         output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                         cu_seqlens_cpu=cu_seqlens_cpu, gate=gate)
    leaving = final.index_select(0, last_doc)  # [B, H, K, V + K]
    return leaving[..., v.shape[-1]:], leaving[..., :v.shape[-1]]


def incoming_states(M: Tensor, S: Tensor, rank: int, initial: Tensor | None = None) -> Tensor:
    """The state entering shard `rank` [B, H, K, V] from the maps of every shard (M [n, B, H, K,
    K], S~ [n, B, H, K, V], shard-major): S_0 = `initial` (zeros), S_{j+1} = M_j S_j + S~_j.

    A static loop over all n shards, those from `rank` on multiplied by 0: every rank's graph
    then uses every gathered map, so every rank runs the gather's backward collective, in the
    same order (a rank that skipped it would leave the others waiting)."""
    state = torch.zeros_like(S[0]) if initial is None else initial.to(S.dtype)
    for j in range(M.shape[0]):
        step = M[j] @ state + S[j]
        state = step if j < rank else state + 0.0 * step
    return state


def kda_from_incoming(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      cu_seqlens: Tensor, first_doc: Tensor, carry: Tensor, state: Tensor,
                      chunk_size: int, gate: KDAGate | None = None,
                      cu_seqlens_cpu: Tensor | None = None) -> Tensor:
    """The shard's KDA output [1, B*L, H, V], each row's entering document started from
    `state` [B, H, K, V] where it continues (`carry`)."""
    init = _entering(state, first_doc, carry, cu_seqlens.numel() - 1)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_seqlens,
                     chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu, gate=gate)
    return o

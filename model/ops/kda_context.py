"""KDA across context-parallel shards (KCP, k3-architecture.md §1.8): the maths, no communication.

A shard of a row acts on the state entering it as an affine map S_out = M S_in + S~ (per head,
M [K, K], S~ [K, V]). One pass of the shard's own tokens from a zero state, with v widened to
[v | 0_K] and the document that enters the shard started from [0 | I], gives both the map and
the output: the recurrence is linear in (S_0, v), so every state of the entering document is
[S~_t | M_t] (M_t the transition product so far), the shard's last document ends in [S~ | M]
(M = 0 wherever a document starts inside the shard or at its first token: the chain is cut
there), and each output is [o~_t | scale M_t^T q_t], o~_t the output from a zero state.
`fragment_pass` runs it, `incoming_states` composes the maps of the shards before this one
(gathered by the caller: `parallel.context_parallel`) into the true entering state S_in, and
`corrected_output` adds its effect, o_t = o~_t + S_in^T (scale M_t^T q_t): exact, with no
second pass over the shard (the right-hand part is 0 outside the entering document). All
three are differentiable, so the state's gradient flows back to earlier shards through
whatever gathered their maps. Payload per shard: B x H x K x (K + V) values, whatever the
length. Shapes only: no host reads.
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


def fragment_pass(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                  first_doc: Tensor, carry: Tensor, last_doc: Tensor, chunk_size: int,
                  gate: KDAGate | None = None, cu_seqlens_cpu: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(M [B, H, K, K], S~ [B, H, K, V], o_wide [1, B*L, H, V + K]) of each row's shard: the
    state leaving it is M @ S_in + S~ for the state S_in entering it, and o_wide feeds
    `corrected_output`. Inputs as `chunk_kda`'s varlen form ([1, B*L, ...] with the shard's
    `cu_seqlens`); `first_doc`, `carry`, `last_doc` [B] as in `model.packing.ContextShard`."""
    H, K = q.shape[2], q.shape[3]
    B = first_doc.shape[0]
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)  # [1, BL, H, V + K]
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=dtype, device=v.device)
    init = torch.cat([torch.zeros(B, H, K, v.shape[-1], dtype=dtype, device=v.device),
                      eye.expand(B, H, K, K)], dim=-1)
    n_docs = cu_seqlens.numel() - 1
    o_wide, final = chunk_kda(q, k, wide, g, beta,
                              initial_state=_entering(init, first_doc, carry, n_docs),
                              output_final_state=True, cu_seqlens=cu_seqlens,
                              chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu, gate=gate)
    leaving = final.index_select(0, last_doc)  # [B, H, K, V + K]
    return leaving[..., v.shape[-1]:], leaving[..., :v.shape[-1]], o_wide


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


def corrected_output(o_wide: Tensor, state: Tensor) -> Tensor:
    """The shard's KDA output [1, B*L, H, V] from `fragment_pass`'s o_wide and the state
    entering each row `state` [B, H, K, V]: o~ + S_in^T (scale M_t^T q_t), token by token (a
    batched GEMM in o_wide's dtype; fla likewise reads its chunk states in the input dtype)."""
    B, H, K, V = state.shape
    _, BL, _, _ = o_wide.shape
    cross = o_wide[..., V:].reshape(B, BL // B, H, K)  # a copy: o_wide itself is not kept
    corr = torch.einsum("blhk,bhkv->blhv", cross, state.to(o_wide.dtype))
    return o_wide[..., :V] + corr.reshape(1, BL, H, V)

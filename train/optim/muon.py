"""K3's optimizer: Per-Head Muon on the decoder's matrices, AdamW on everything else.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) for a matrix parameter W with gradient G:
    B <- lerp(B, G, 1 - mu)                         momentum (EMA form, torch.optim.Muon's)
    U <- lerp(G, B, mu)  (Nesterov; else U = B)
    O <- NS5(U)          per block: 5 quintic Newton-Schulz steps, X <- aX + (bA + cA^2) X with
                         A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315), X0 = U / ||U||_F
                         (transposed so that rows <= cols), in bf16 on CUDA as the
                         Muon/Moonlight papers and torch.optim.Muon do, fp32 on CPU (`ns_dtype`),
                         float64 for float64 parameters (the verification mode)
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) * O     per block shape (Moonlight's
                         AdamW-RMS match, so one learning rate serves both optimizers)
"Per-head": the blocks are not always whole matrices (`muon_blocks`):
- KDA q/k/v projections: one block per head (head_dim rows);
- MLA q (or q_b) projection: one block per head (q/k head dim, 192 rows); kv_b_proj: per head,
  its k_C rows and its v rows as two separate blocks; the down-projections whole;
- routed experts [E, out, in]: each expert's matrix on its own;
- every other 2-D decoder matrix whole (output, MLP, shared-expert, latent and gate
  projections).
AdamW (`optim.betas`, `optim.eps`; weight decay as `train.optim.build.no_weight_decay` says) takes
the embedding, the LM head, norms and other vectors, AttnRes pseudo-queries, A_log / dt_bias, the
short-conv kernels and the router (`adamw_only`). Blocks of one shape are orthogonalised
together in one batched Newton-Schulz (no Python loop over heads or experts).

`MuonAdamW` is one `torch.optim.Optimizer` over both (one state dict for DCP, one LR scheduler):
its AdamW groups are driven by an inner `torch.optim.AdamW` (fused on CUDA) sharing the same
group dicts and state. Sharded matrices are orthogonalised on the rank that holds whole blocks
of them, or on one owner rank per TP shard group (FSDP, FSDP x TP), see `train.optim.muon_dist`;
every layout equals one rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from train.optim.muon_dist import (
    OwnerExchange,
    Route,
    gather_inner,
    inner_part,
    local_part,
    route,
)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


@dataclass(frozen=True)
class Blocks:
    """How a parameter splits into Muon blocks: viewed as [n, sum(rows), cols], each of the n
    slices cut along its rows into `rows` blocks. n = the parameter's leading rows / sum(rows)
    (heads, or experts for a 3-D stack)."""

    rows: tuple[int, ...] | None = None  # None: each [out, in] matrix whole

    def views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The blocks of t as [n, r, cols] tensors (views where the split allows)."""
        if t.ndim == 3:  # stacked experts: [E, out, in], each expert on its own
            mats = t
        else:
            mats = t.unsqueeze(0)
        if self.rows is None:
            return [mats]
        n_rows, cols = mats.shape[-2:]
        per = sum(self.rows)
        if n_rows % per:
            raise ValueError(f"Muon blocks {self.rows} do not tile {n_rows} rows")
        heads = mats.reshape(-1, per, cols)  # [n, per, cols]
        return list(heads.split(list(self.rows), dim=1))

    def assemble(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Inverse of `views`."""
        if self.rows is None:
            return parts[0].reshape(like.shape)
        return torch.cat(parts, dim=1).reshape(like.shape)


def muon_blocks(model: nn.Module) -> dict[str, Blocks]:
    """Parameter name -> its Muon blocks, for every parameter Muon takes (module docstring)."""
    from model.kda import KimiDeltaAttention
    from model.mla import GatedMLA
    from model.moe import RoutedExperts

    per_module: dict[str, Blocks] = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, KimiDeltaAttention):
            for proj in ("q_proj", "k_proj", "v_proj"):
                per_module[f"{prefix}{proj}.weight"] = Blocks((module.head_dim,))
        elif isinstance(module, GatedMLA):
            qk = module.nope + module.rope
            for proj in ("q_proj", "q_b_proj"):
                per_module[f"{prefix}{proj}.weight"] = Blocks((qk,))
            per_module[f"{prefix}kv_b_proj.weight"] = Blocks((module.nope, module.v_dim))
        elif isinstance(module, RoutedExperts):
            for w in ("w1", "w3", "w2"):
                per_module[f"{prefix}{w}"] = Blocks()
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or adamw_only(name, p):
            continue
        out[name] = per_module.get(name, Blocks())
    return out


def adamw_only(name: str, p: torch.Tensor) -> bool:
    """Parameters Muon never takes: vectors, the embedding and LM head, AttnRes
    pseudo-queries, the short-conv kernels and the router."""
    return (p.ndim < 2 or "embed_tokens" in name or "lm_head" in name
            or name.endswith("_res_proj.weight") or "conv1d" in name
            or name.endswith(".gate.weight"))  # the MoE router (`LatentMoE.gate`)


def ns_dtype(x: torch.Tensor) -> torch.dtype:
    """The iteration's precision: bf16 on CUDA (the Muon / Moonlight papers, torch.optim.Muon),
    fp32 on CPU (whose bf16 GEMMs are ~30x slower than fp32 ones), fp64 for fp64 inputs."""
    if x.dtype == torch.float64:
        return torch.float64
    return torch.bfloat16 if x.is_cuda else torch.float32


def newton_schulz(x: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalisation of each matrix of x [n, r, c] (module
    docstring) in `dtype` (default `ns_dtype`); returns x's dtype."""
    dtype = dtype or ns_dtype(x)
    a, b, c = NS_COEFFICIENTS
    X = x.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.to(x.dtype)


def rms_matched_lr(lr: float, rows: int, cols: int) -> float:
    """Moonlight's scaling: the update's RMS matches AdamW's (torch's "match_rms_adamw")."""
    return 0.2 * math.sqrt(max(rows, cols)) * lr


class MuonAdamW(torch.optim.Optimizer):
    """Muon on `blocks`' parameters, AdamW on the rest (module docstring)."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, fused_adamw: bool | None = None) -> None:
        from train.optim.build import no_weight_decay

        blocks = muon_blocks(model)
        muon, decay, no_decay = [], [], []
        self._blocks: dict[torch.Tensor, Blocks] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name in blocks:
                muon.append(p)
                self._blocks[p] = blocks[name]
            else:
                (no_decay if no_weight_decay(name, p) else decay).append(p)
        self._adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=betas, eps=eps, fused=fused_adamw)
        for g in self._adamw.param_groups:
            g["algo"] = "adamw"
        muon_group = {"params": muon, "algo": "muon", "lr": lr, "weight_decay": weight_decay,
                      "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps}
        super().__init__([muon_group], {"lr": lr})
        self.param_groups.extend(self._adamw.param_groups)  # the same dicts: one scheduler
        self._adamw.state = self.state  # one state for both: one state dict
        self._exchanges: dict[tuple, OwnerExchange] = {}

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._adamw.state = self.state  # the base class rebinds self.state
        self._adamw.param_groups = [g for g in self.param_groups if g["algo"] == "adamw"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algo"] == "muon":
                self._muon_step(group)
        self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        local: list[tuple[torch.Tensor, Blocks, torch.Tensor]] = []  # this rank's blocks
        gathered: list[tuple[torch.Tensor, Blocks, torch.Tensor]] = []  # whole matrices
        remote: dict[tuple, list] = defaultdict(list)  # owner exchange, by shard group
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            spec = self._blocks[p]
            r = route(p, _tile(p, spec))
            if r.kind == "gather":
                gathered.append((p, spec, update.full_tensor()))
            elif r.kind == "local":
                local.append((_local(p), spec, _local(update)))
            else:
                remote[(p.device_mesh, r.outer)].append((p, spec, update, r))
        deltas = self._deltas(group, [(spec, u) for _, spec, u in local + gathered])
        for (p, _, _), d in zip(local + gathered, deltas):
            p_local = p if not isinstance(p, DTensor) else p.to_local()
            p_local.mul_(1 - lr * wd)
            p_local.sub_(d if not isinstance(p, DTensor) else local_part(d, p))
        for items in remote.values():
            exchange = self._exchange(items)
            rows = exchange.step([u.to_local() for _, _, u, _ in items],
                                 lambda idx, full, items=items: self._owned(group, items, idx,
                                                                            full))
            for (p, _, _, _), d in zip(items, rows):
                p_local = p.to_local()
                p_local.mul_(1 - lr * wd)
                p_local.sub_(d)

    def _owned(self, group: dict, items: list, idx: list[int], full: list[torch.Tensor]
               ) -> list[torch.Tensor]:
        """The deltas of the matrices this rank owns (`full`: their assembled shards); those
        TP also splits are first joined over tp with the other tp ranks' owners of them."""
        mesh = items[0][0].device_mesh
        joined = [j for j, i in enumerate(idx) if items[i][3].inner is not None]
        if joined:
            r0 = items[idx[joined[0]]][3]
            whole = gather_inner([full[j] for j in joined], mesh, r0.inner,
                                 [items[idx[j]][3].inner_dim for j in joined])
            for j, w in zip(joined, whole):
                full[j] = w
        deltas = self._deltas(group, [(items[i][1], f) for i, f in zip(idx, full)])
        for j in joined:
            r = items[idx[j]][3]
            deltas[j] = inner_part(deltas[j], mesh, r.inner, r.inner_dim)
        return deltas

    def _deltas(self, group: dict, items: list[tuple[Blocks, torch.Tensor]]
                ) -> list[torch.Tensor]:
        """lr-scaled orthogonalised updates of whole matrices; blocks of one shape batched."""
        by_shape: dict[tuple[int, int, torch.dtype], list] = defaultdict(list)
        slots = []
        for spec, update in items:
            mine = []
            for part in spec.views(update):
                key = (part.shape[-2], part.shape[-1], part.dtype)
                mine.append((key, len(by_shape[key])))
                by_shape[key].append(part)
            slots.append(mine)
        done = {key: newton_schulz(torch.cat(parts), group["ns_steps"]).split(
            [t.shape[0] for t in parts]) for key, parts in by_shape.items()}
        lr = group["lr"]
        return [spec.assemble([done[key][i] * rms_matched_lr(lr, key[0], key[1])
                               for key, i in mine], update)
                for (spec, update), mine in zip(items, slots)]

    def _exchange(self, items: list) -> OwnerExchange:
        """The owner plan of these sharded matrices (made once: shapes never change)."""
        key = tuple(id(it[0]) for it in items)
        if key not in self._exchanges:
            self._exchanges[key] = owner_exchange([(p, spec, r) for p, spec, _, r in items])
        return self._exchanges[key]


def owner_exchange(items: list[tuple[torch.Tensor, Blocks, Route]]) -> OwnerExchange:
    """The owner plan of matrices exchanged over one mesh dim, owners balanced by the FLOPs of
    the Newton-Schulz they run (of the whole matrix where the owners join TP's shards)."""
    p0, _, r0 = items[0]
    group = p0.device_mesh.get_group(r0.outer)
    costs, sends = [], []
    for p, spec, r in items:
        shape = p.shape if r.inner is not None else r.shape
        costs.append(sum(ns_flops(*part.shape[-2:]) * part.shape[0]
                         for part in spec.views(torch.empty(shape, device="meta"))))
        sends.append(0 if r.inner is None else
                     math.prod(r.shape) * (p.device_mesh.size(r.inner) - 1))
    return OwnerExchange(group, [r.shape for _, _, r in items], costs, sends)


def exchange_plans(model: nn.Module) -> list[OwnerExchange]:
    """The owner exchanges `MuonAdamW` makes for `model`'s (sharded) parameters."""
    blocks = muon_blocks(model)
    groups: dict[tuple, list] = defaultdict(list)
    for name, p in model.named_parameters():
        if name not in blocks:
            continue
        r = route(p, _tile(p, blocks[name]))
        if r.kind == "owner":
            groups[(p.device_mesh, r.outer)].append((p, blocks[name], r))
    return [owner_exchange(items) for items in groups.values()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tile(p: torch.Tensor, spec: Blocks) -> int:
    """Dim-0 entries of one Muon block of p: 1 expert of a stack, else its block rows."""
    if p.ndim == 3:
        return 1
    return p.shape[0] if spec.rows is None else sum(spec.rows)


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of the quintic Newton-Schulz on one [rows, cols] block."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4 * r * r * c + 2 * r ** 3)

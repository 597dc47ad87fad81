"""Held-out validation loss every `eval.every` steps, in any layout.

The validation split is a prepared folder of whole documents held out from training
(`python -m data.prepare ... --val-fraction F` writes it to `<output>/val`; the embedded default
corpus has one). Each evaluation reads the same `eval.batches` global batches of it (the
loader's order from position 0), so successive values are comparable, through the model in
eval mode under no_grad: routers record no balancing statistics and nothing is updated. The
value is the token mean of the next-token loss over those batches, reduced like the training
loss, so it is equal across layouts; with MTP the MTP head's loss is reported beside it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from data.loader import BatchLoader, local_target_tokens
from model.mtp import stack_targets
from model.packing import Packing, check_cu_seqlens, pad_cu_seqlens, shard_window, to_device
from parallel.pipeline_forward import forward_through_stages


class Validator:
    """Runs the validation batches of this data rank and reduces their loss over all ranks."""

    def __init__(self, loader: BatchLoader, batches: int) -> None:
        self.loader, self.batches = loader, batches

    @torch.no_grad()
    def losses(self, pm, env, act_dtype: torch.dtype) -> dict[str, float]:
        """{val_loss[, val_mtp_loss]} (every rank calls together)."""
        model = pm.model
        cfg = model.config
        mtp = cfg.num_nextn_predict_layers > 0
        self.loader.position = 0
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        tokens = mtp_tokens = 0
        with _eval_mode(model):
            for _ in range(self.batches):
                batches = self.loader.next_step()
                tokens += local_target_tokens(batches)
                for mb in batches:
                    labels = stack_targets(mb["labels"]) if mtp else mb["labels"]
                    if mtp:
                        mtp_tokens += int((labels[..., 1] != -100).sum())
                    loss_sum += _micro_batch_loss(pm, mb, labels, env.device, act_dtype)
        mtp_sum = sum(s.double() for s in model.mtp_loss_sums) if model.mtp_loss_sums else 0.0
        model.mtp_loss_sums.clear()
        sums = torch.stack([loss_sum, torch.as_tensor(mtp_sum, dtype=torch.float64,
                                                      device=env.device)])
        counts = torch.tensor([tokens, mtp_tokens], dtype=torch.float64, device=env.device)
        dist.all_reduce(sums)  # every rank; 0 off the last pipeline stage
        dist.all_reduce(counts, group=pm.meshes.dp_group)
        total, mtp_total = (sums / pm.dims.tp).tolist()  # vocabulary-parallel: tp full copies
        n, n_mtp = counts.tolist()
        main = total - cfg.mtp_loss_weight * mtp_total if mtp else total
        out = {"val_loss": main / max(n, 1)}
        if mtp:
            out["val_mtp_loss"] = mtp_total / max(n_mtp, 1)
        return out


def _micro_batch_loss(pm, mb: dict, labels: torch.Tensor, device: torch.device,
                      act_dtype: torch.dtype) -> torch.Tensor:
    """This rank's loss sum of one micro-batch (float64; 0 off the last pipeline stage)."""
    model = pm.model
    ids = to_device(mb["input_ids"], device)
    labels = to_device(labels, device)
    if model.context_shard is not None:
        labels = shard_window(labels, *model.context_shard)
    if pm.schedule is None:
        packing = Packing.from_host(mb["cu_seqlens"], *ids.shape, device, bucket=pm.compiled)
        s, _ = model(ids, packing, labels=labels)
        return s.double()
    B, T = ids.shape
    longest = check_cu_seqlens(mb["cu_seqlens"], B, T)
    kw = {"cu_seqlens": to_device(pad_cu_seqlens([mb["cu_seqlens"]], B * T), device),
          "seq_len": T, "max_seqlen": longest}
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s, result, _ in forward_through_stages(pm, ids, kw, labels, act_dtype):
        if s == pm.dims.num_stages - 1:
            total += result.double()
    return total


@contextlib.contextmanager
def _eval_mode(model):
    modes = {m: m.training for m in model.modules()}
    model.eval()  # routers record no statistics
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training

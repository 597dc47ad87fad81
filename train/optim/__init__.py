"""Optimizers and what acts on the weights after a step.

- `build.py`: `build_optimizer` (AdamW with K3's weight-decay exclusions, or Muon + AdamW) and
  `build_scheduler` (cosine, WSD);
- `muon.py`: K3's Per-Head Muon (`MuonAdamW`, the block split `muon_blocks`, Newton-Schulz);
- `muon_dist.py`: Muon over FSDP2 / TP shards (each matrix orthogonalised once, on an owner);
- `qk_clip.py`: QK-Clip of the Gated MLA heads after the optimizer step, and the logit tracking
  it reads (also on without clipping: `train.track_attn_logits`).
"""

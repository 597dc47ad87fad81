"""Export a training checkpoint as Kimi K3 Hugging Face safetensors (k3-architecture.md §7.1).

    python -m train.checkpoint.export_hf RUN_DIR_OR_CHECKPOINT_DIR --output OUT [--step N]
        [--dtype bf16|fp32] [--max-shard-gb 5] [--overwrite]

Reads the model part of one DCP checkpoint (`<run>/checkpoints/step-XXXXXXXX/`, the latest
complete one unless `--step`) in this single process, renames our tensors to K3's checkpoint
names (`language_model.model.<our name>`, `language_model.lm_head.weight`, the stacked routed
experts [E, out, in] split into `experts.{e}.w1|w2|w3.weight`), and writes size-capped
`model-0000i-of-0000N.safetensors` shards, `model.safetensors.index.json` and a `config.json`
(`KimiK3ForConditionalGeneration`, text_config `kimi_linear`). With bf16 the tensors K3 keeps in
fp32 (`model.init.keeps_fp32`, router bias) stay fp32. The output appears atomically (written to
`OUT.tmp-<pid>`, then renamed). `load_hf_state_dict` reads an export back in our naming.

The MTP module (`model.num_nextn_predict_layers=1`) is written in DeepSeek-V3's convention: as
decoder layer `num_hidden_layers` (`layers.{L}.enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
its decoder layer's tensors under `layers.{L}.`, our `h_proj` when AttnRes features are fused),
with copies of the shared embedding and LM head as `layers.{L}.embed_tokens` and
`layers.{L}.shared_head.head` (which readers of that convention load; skipped on reading back).

Deliberately not: vision tower weights (we train none), MXFP4 quantisation of the experts,
tokenizer files, shape changes for other HF ports (e.g. A_log as [1, 1, H, 1]), streaming for
checkpoints larger than host memory, and the Quantile-Balancing statistics (`qb_counts`,
`expert_load`), which are training state, not weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from model.config import ConfigError, ModelConfig
from model.decoder import K3Model
from model.init import keeps_fp32
from train.checkpoint.checkpointer import STEP_DIR, Checkpointer

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
SKIPPED = ("qb_counts", "expert_load")  # Quantile-Balancing statistics, not weights
INDEX = "model.safetensors.index.json"
_STACKED = re.compile(r"^(layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")
_PER_EXPERT = re.compile(
    r"^language_model\.model\.(layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight$")
# ModelConfig field -> linear_attn_config key; fields that change no weight go under "k3train".
_LINEAR = {"kda_head_dim": "head_dim", "kda_num_heads": "num_heads",
           "short_conv_kernel_size": "short_conv_kernel_size",
           "use_full_rank_gate": "use_full_rank_gate", "gate_lower_bound": "gate_lower_bound"}
_TRAINING_ONLY = ("kda_chunk_size", "qb_num_bins", "loss_chunk_tokens", "loss_grads_in_forward",
                  "mtp_loss_weight")
_MTP_OWN = ("enorm", "hnorm", "eh_proj", "h_proj", "shared_head")  # mtp.<these>; else mtp.layer
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ExportError(Exception):
    """A user-facing problem (bad path, no checkpoint, existing output); one line."""


# ----------------------------------------------------------------------------- names
def hf_name(our_name: str, num_experts: int) -> list[str]:
    """K3 HF name(s) of one of our state-dict entries: one per expert for the stacked experts,
    none for the QB statistics."""
    if our_name.rsplit(".", 1)[-1] in SKIPPED:
        return []
    if our_name == "lm_head.weight":
        return [LM_HEAD]
    m = _STACKED.match(our_name)
    if m:
        return [f"{PREFIX}{m[1]}.{e}.{m[2]}.weight" for e in range(num_experts)]
    return [PREFIX + our_name]


def our_name(name: str) -> tuple[str, int | None]:
    """Inverse of `hf_name`: (our name, expert index or None)."""
    if name == LM_HEAD:
        return "lm_head.weight", None
    m = _PER_EXPERT.match(name)
    if m:
        return f"{m[1]}.{m[3]}", int(m[2])
    if not name.startswith(PREFIX):
        raise ExportError(f"tensor {name!r} is not a K3 text-model tensor ({PREFIX}*)")
    return name[len(PREFIX):], None


def mtp_as_layer(name: str, n_layers: int) -> str:
    """Our MTP names as decoder layer `n_layers` (DeepSeek-V3's convention); others unchanged."""
    for ours in ("mtp.layer.", "mtp."):
        if name.startswith(ours):
            return f"layers.{n_layers}.{name[len(ours):]}"
    return name


def layer_as_mtp(name: str, n_layers: int) -> str:
    """Inverse of `mtp_as_layer`."""
    head = f"layers.{n_layers}."
    if not name.startswith(head):
        return name
    rest = name[len(head):]
    return ("mtp." if rest.split(".")[0] in _MTP_OWN else "mtp.layer.") + rest


def _mtp_copies(n_layers: int) -> dict[str, str]:
    """HF names of the MTP layer's copies of the shared tensors -> our tensor."""
    return {f"{PREFIX}layers.{n_layers}.embed_tokens.weight": "embed_tokens.weight",
            f"{PREFIX}layers.{n_layers}.shared_head.head.weight": "lm_head.weight"}


def keeps_fp32_hf(our: str) -> bool:
    """Whether K3 stores this tensor in fp32 whatever the export dtype."""
    return keeps_fp32(our) or our.endswith("e_score_correction_bias")


def hf_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype, cfg: ModelConfig
               ) -> Iterator[tuple[str, torch.Tensor, torch.dtype]]:
    """(HF name, source view, dtype to store) for every exported tensor, in state-dict order
    (the MTP layer's copies of the embedding and head last)."""
    L = cfg.num_hidden_layers
    for name, t in state.items():
        layer_name = mtp_as_layer(name, L)
        stacked = _STACKED.match(layer_name) is not None
        names = hf_name(layer_name, t.shape[0] if stacked else 0)
        out_dtype = dtype if t.is_floating_point() and not keeps_fp32_hf(name) else t.dtype
        for i, hf in enumerate(names):
            yield hf, t[i] if stacked else t, out_dtype
    if cfg.num_nextn_predict_layers:
        for hf, ours in _mtp_copies(L).items():
            yield hf, state[ours], dtype


# ------------------------------------------------------------------------ checkpoint
def _complete(d: Path) -> bool:
    return (d / ".metadata").is_file() and (d / "train_state.json").is_file()


def resolve_checkpoint(path: Path, step: int | None = None) -> Path:
    """A checkpoint directory, or a run directory's latest (or `step`) complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path} is not a directory (give a run or checkpoint directory)")
    if STEP_DIR.match(path.name) or (path / ".metadata").exists():
        if not _complete(path):
            raise ExportError(f"{path} is not a complete checkpoint (needs .metadata and "
                              "train_state.json)")
        if step is not None and not path.name.endswith(f"{step:08d}"):
            raise ExportError(f"--step {step} does not match checkpoint directory {path}")
        return path
    steps = Checkpointer(path / "checkpoints", keep=1, rank=0).complete_steps()
    if not steps:
        raise ExportError(f"no complete checkpoint under {path / 'checkpoints'} (needs "
                          "step-XXXXXXXX/ with .metadata and train_state.json)")
    if step is not None and step not in steps:
        raise ExportError(f"no complete checkpoint for --step {step} in {path}; have {steps}")
    return path / "checkpoints" / f"step-{(steps[-1] if step is None else step):08d}"


def load_model(checkpoint: Path) -> tuple[K3Model, dict[str, Any]]:
    """Build the checkpoint's model on CPU and fill every tensor from its DCP shards."""
    train_state = json.loads((checkpoint / "train_state.json").read_text())
    if "model_config" not in train_state:
        raise ExportError(f"{checkpoint}/train_state.json has no model_config")
    cfg = ModelConfig.from_dict(train_state["model_config"])
    model = K3Model(cfg, device="meta").to_empty(device="cpu")
    state = model.state_dict()
    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    missing = [k for k in state if f"model.{k}" not in stored]
    bad = [k for k in state if f"model.{k}" in stored
           and tuple(stored[f"model.{k}"].size) != tuple(state[k].shape)]
    if missing or bad:
        raise ExportError(f"{checkpoint} does not match its model_config: missing {missing[:3]}"
                          f" ({len(missing)}), wrong shape {bad[:3]} ({len(bad)})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load({"model": state}, checkpoint_id=str(checkpoint))
    return model, train_state


# ---------------------------------------------------------------------------- config
def hf_config(cfg: ModelConfig, dtype: torch.dtype, step: int, source: Path) -> dict[str, Any]:
    """K3's HF config.json (text_config model_type kimi_linear) for `cfg`."""
    text = cfg.to_dict()
    linear = {hf: text.pop(ours) for ours, hf in _LINEAR.items()}
    full = sorted(text.pop("full_attn_layers"))
    linear["full_attn_layers"] = full
    linear["kda_layers"] = [i for i in range(1, cfg.num_hidden_layers + 1) if i not in full]
    knobs = {k: text.pop(k) for k in _TRAINING_ONLY}
    dtype_name = str(dtype).removeprefix("torch.")
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "torch_dtype": dtype_name,
            "text_config": {"model_type": "kimi_linear", **text, "linear_attn_config": linear,
                            "torch_dtype": dtype_name},
            "k3train": {"step": step, "source": str(source), "training_fields": knobs}}


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """Inverse of `hf_config`: our ModelConfig from an exported config.json."""
    text = {k: v for k, v in config["text_config"].items()
            if k not in ("model_type", "torch_dtype", "linear_attn_config")}
    linear = config["text_config"]["linear_attn_config"]
    text.update({ours: linear[hf] for ours, hf in _LINEAR.items()})
    text["full_attn_layers"] = linear["full_attn_layers"]
    text.update(config.get("k3train", {}).get("training_fields", {}))
    return ModelConfig.from_dict(text)


# ----------------------------------------------------------------------------- write
def export_hf(checkpoint: Path, output: Path, dtype: torch.dtype = torch.bfloat16,
              max_shard_bytes: float = 5e9, overwrite: bool = False) -> Path:
    """Export one checkpoint directory to `output` (atomically); returns `output`."""
    checkpoint, output = Path(checkpoint), Path(output)
    if output.exists() and not overwrite:
        raise ExportError(f"{output} already exists; pass --overwrite to replace it")
    model, train_state = load_model(checkpoint)
    state = model.state_dict()
    plan: list[list[tuple[str, int]]] = [[]]  # shards of (HF name, bytes), before writing any
    size = 0
    for hf, t, out_dtype in hf_tensors(state, dtype, model.config):
        n = t.numel() * out_dtype.itemsize
        if plan[-1] and size + n > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((hf, n))
        size += n
    total = sum(n for shard in plan for _, n in shard)
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    shard_of = {hf: files[i] for i, shard in enumerate(plan) for hf, _ in shard}

    tmp = output.parent / f"{output.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        config = hf_config(model.config, dtype, train_state.get("step", -1), checkpoint.resolve())
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        mode = (tmp / "config.json").stat().st_mode  # safetensors creates files 0600
        pending: dict[str, dict[str, torch.Tensor]] = {f: {} for f in files}
        left = Counter(shard_of.values())
        for hf, t, out_dtype in hf_tensors(state, dtype, model.config):  # each shard once complete
            f = shard_of[hf]  # own storage (clone): safetensors refuses tensors that share
            pending[f][hf] = t.to(out_dtype, memory_format=torch.contiguous_format, copy=True)
            left[f] -= 1
            if left[f] == 0:
                save_file(pending.pop(f), str(tmp / f), metadata={"format": "pt"})
                os.chmod(tmp / f, mode)
        index = {"metadata": {"total_size": total}, "weight_map": shard_of}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        old = output.parent / f"{output.name}.old-{os.getpid()}"
        if output.exists():
            os.replace(output, old)
        try:
            os.replace(tmp, output)
        except OSError:
            if old.exists():
                os.replace(old, output)  # put the previous export back
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def load_hf_state_dict(output_dir: Path) -> dict[str, torch.Tensor]:
    """Read an export back as our state dict (experts re-stacked; no QB statistics; the MTP
    layer's copies of the embedding and head skipped)."""
    output_dir = Path(output_dir)
    weight_map = json.loads((output_dir / INDEX).read_text())["weight_map"]
    L = json.loads((output_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
    weight_map = {k: v for k, v in weight_map.items() if k not in _mtp_copies(L)}
    flat: dict[str, torch.Tensor] = {}
    for f in dict.fromkeys(weight_map.values()):
        flat.update(load_file(str(output_dir / f)))
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in weight_map:
        ours, e = our_name(name)
        ours = layer_as_mtp(ours, L)
        if e is None:
            state[ours] = flat[name]
        else:
            experts.setdefault(ours, {})[e] = flat[name]
            state.setdefault(ours, flat[name])  # placeholder keeps state-dict order
    for ours, parts in experts.items():
        if sorted(parts) != list(range(len(parts))):
            raise ExportError(f"{output_dir}: experts of {ours} are not 0..{len(parts) - 1}")
        state[ours] = torch.stack([parts[e] for e in range(len(parts))])
    return state


# ------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.checkpoint.export_hf",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="run directory or checkpoint directory")
    p.add_argument("--output", type=Path, required=True, help="export directory (created)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="shard size cap (1e9 bytes)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = p.parse_args(argv)
    try:
        if args.output.exists() and not args.overwrite:
            raise ExportError(f"{args.output} already exists; pass --overwrite to replace it")
        if args.max_shard_gb <= 0:
            raise ExportError(f"--max-shard-gb {args.max_shard_gb} must be > 0")
        ckpt = resolve_checkpoint(args.source, args.step)
        out = export_hf(ckpt, args.output, DTYPES[args.dtype], args.max_shard_gb * 1e9,
                        overwrite=args.overwrite)
    except (ExportError, ConfigError, OSError, ValueError, CheckpointException) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"export_hf: error: {msg}", file=sys.stderr)
        return 2
    index = json.loads((out / INDEX).read_text())
    n_files = len(set(index["weight_map"].values()))
    print(f"exported {ckpt} -> {out}: {len(index['weight_map'])} tensors, "
          f"{index['metadata']['total_size'] / 1e9:.3f} GB in {n_files} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

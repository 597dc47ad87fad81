"""Import Kimi K3 from Hugging Face safetensors (K3's release, or our own export) as a run
directory that `launch/pretrain.py` continues in any layout.

    python -m train.checkpoint.import_hf HF_DIR --output RUN_DIR [--tokenizer DIR|none]
        [--ignore-field NAME ...] [--overwrite] [model.FIELD=VALUE ...]
    torchrun --nproc_per_node=N -m train.checkpoint.import_hf ...      # N ranks write a share each
    torchrun ... launch/pretrain.py +cluster=<name> run.dir=RUN_DIR data=... [overrides]

Reads `config.json`: `text_config` onto `ModelConfig` (K3's field names are ours;
`linear_attn_config` holds the KDA fields; our export's `k3train.training_fields` too). Fields
known to change no weight (`vision_config`, inference-only ones: `IGNORED_TOP`, `IGNORED_TEXT`)
are skipped and logged; any other unknown field is a one-line error (`--ignore-field NAME`
accepts it). `quantization_config` must be compressed-tensors `mxfp4-pack-quantized` (K3's
routed experts: E2M1 codes, one E8M0 scale per 32, `model.ops.mxfp4`) or absent.

Reads the safetensors index and shards through `train.checkpoint.release_reader.ReleaseReader`
(torch DCP's `HuggingFaceStorageReader` in our names): every `language_model.*` tensor, renamed as
`train.checkpoint.export_hf` names it (per-expert tensors stacked back into [E, out, in]); vision
and projector tensors are skipped and counted; `<name>.weight_packed` + `weight_scale` pairs are
dequantised exactly into float32. Every name and shape is checked against the model before
anything is written. (`release_reader.load_release` loads a release straight into a sharded
model instead, each rank reading its own shard.)

Writes `RUN_DIR/checkpoints/step-00000000/`, a model-only checkpoint (`Checkpointer.save_weights`,
checksums included): the trainer loads it into any layout with a fresh optimizer, schedule and
data order, router biases from the checkpoint, Quantile-Balancing statistics empty. Also
`RUN_DIR/tokenizer/` (a copy of the checkpoint's tokenizer files, for `data.tokenizer=`) and
`RUN_DIR/import.json` (what was read and skipped). On an error nothing stays behind.

Streaming: DCP plans the save over meta tensors and `_LazyPlanner` reads (and dequantises) each
tensor through the reader only when DCP writes it, so the peak memory is about the largest tensor
(a stacked expert weight in float32), not the model; under torchrun DCP splits the tensors
between the ranks and each reads only its own.

K3's release is the post-trained model (MXFP4 quantisation-aware training from SFT on, so its
experts are MXFP4): continued pretraining starts from those weights, not from a base model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from model.config import ConfigError, ModelConfig
from model.inspect import parse_model_overrides
from model.ops.mxfp4 import GROUP
from train.checkpoint.checkpointer import Checkpointer, root_cause
from train.checkpoint.export_hf import _LINEAR
from train.checkpoint.release_reader import ImportHFError, ReleaseReader, _first_line

# config.json fields that change no weight of the text model
IGNORED_TOP = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
               "auto_map", "vision_config", "media_placeholder_token_id", "image_token_index",
               "ignore_index", "use_cache", "_name_or_path", "bos_token_id", "eos_token_id",
               "pad_token_id", "tie_word_embeddings")
IGNORED_TEXT = ("model_type", "torch_dtype", "dtype", "architectures", "transformers_version",
                "auto_map", "_name_or_path", "use_cache", "rope_theta", "rope_scaling",
                "attention_dropout", "attention_bias", "mlp_bias", "pretraining_tp",
                "output_attentions", "output_hidden_states", "return_dict", "kv_cache_dtype")
FORMAT = "mxfp4-pack-quantized"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json",
                   "special_tokens_map.json")


# ---------------------------------------------------------------------------- config
def model_config_from_release(config: dict[str, Any], ignore: tuple[str, ...] = (),
                              overrides: dict[str, Any] | None = None
                              ) -> tuple[ModelConfig, dict | None, list[str]]:
    """(ModelConfig, quantization_config or None, skipped field names) of a K3 config.json."""
    skipped: list[str] = []
    for k in config:
        if k in ("text_config", "quantization_config", "k3train"):
            continue
        if k not in IGNORED_TOP and k not in ignore:
            raise ImportHFError(f"config.json field {k!r} is unknown to k3train; if it changes "
                                f"no weight of the text model, pass --ignore-field {k}")
        skipped.append(k)
    if not isinstance(config.get("text_config"), dict):
        raise ImportHFError("config.json has no text_config (a Kimi K3 checkpoint has one, "
                            "model_type kimi_linear)")
    text = dict(config["text_config"])
    quant = config.get("quantization_config") or text.pop("quantization_config", None)
    text.pop("quantization_config", None)
    linear = text.pop("linear_attn_config", None)
    if not isinstance(linear, dict):
        raise ImportHFError("config.json text_config has no linear_attn_config (KDA's "
                            "head_dim, num_heads, full_attn_layers, ...)")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields: dict[str, Any] = {}
    for k, v in text.items():
        if k in known:
            fields[k] = v
        elif k in IGNORED_TEXT or k in ignore:
            skipped.append(f"text_config.{k}")
        else:
            raise ImportHFError(f"config.json text_config.{k} is unknown to k3train; if it "
                                f"changes no weight, pass --ignore-field {k}")
    linear_names = {hf: ours for ours, hf in _LINEAR.items()}
    for k, v in linear.items():
        if k in linear_names:
            fields[linear_names[k]] = v
        elif k == "full_attn_layers":
            fields["full_attn_layers"] = list(v)
        elif k == "kda_layers" or k in ignore:
            continue
        else:
            raise ImportHFError(f"config.json linear_attn_config.{k} is unknown to k3train; if "
                                f"it changes no weight, pass --ignore-field {k}")
    L = fields.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    full = set(fields.get("full_attn_layers", []))
    if "kda_layers" in linear and set(linear["kda_layers"]) != set(range(1, L + 1)) - full:
        raise ImportHFError("config.json linear_attn_config: kda_layers and full_attn_layers "
                            f"must split layers 1..{L} between them")
    fields.update(config.get("k3train", {}).get("training_fields", {}))  # our own export
    fields.update(overrides or {})
    try:
        cfg = ModelConfig.from_dict(fields)
    except ConfigError as e:
        raise ImportHFError(f"config.json: {e}") from None
    check_quantization(quant)
    return cfg, quant, skipped


def read_release_config(folder: Path) -> dict[str, Any]:
    """The checkpoint's config.json, or a one-line ImportHFError."""
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ImportHFError(f"{Path(folder) / 'config.json'} cannot be read ({_first_line(e)})"
                            ) from None


def check_quantization(quant: dict | None) -> None:
    """Only compressed-tensors MXFP4 (group 32, 4-bit float weights) or no quantisation."""
    if not quant:
        return
    if quant.get("quant_method") != "compressed-tensors":
        raise ImportHFError(f"quantization_config.quant_method={quant.get('quant_method')!r} "
                            f"is not supported; k3train reads compressed-tensors {FORMAT} "
                            "(K3's release) or unquantised checkpoints")
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values()}
    bad = sorted(str(f) for f in formats - {None, FORMAT})
    if bad:
        raise ImportHFError(f"quantization format {bad[0]!r} is not supported; k3train reads "
                            f"{FORMAT} (K3's release) or unquantised checkpoints")
    for name, g in groups.items():
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", GROUP):
            raise ImportHFError(f"quantization_config.config_groups.{name}.weights must be "
                                f"num_bits 4, type float, group_size {GROUP} ({FORMAT})")


class _LazyPlanner(DefaultSavePlanner):
    """Plans over meta tensors; hands DCP each real tensor only when it writes it."""

    def __init__(self, load) -> None:
        super().__init__()
        self._load = load

    def lookup_object(self, index):
        return self._load(index.fqn.removeprefix("model."))


# ---------------------------------------------------------------------------- import
def import_hf(folder: Path, output: Path, tokenizer: str | None = "auto",
              ignore: tuple[str, ...] = (), overrides: dict[str, Any] | None = None,
              log=print) -> dict[str, Any]:
    """Import `folder` into the run directory `output` (every rank calls, inside a process
    group); returns the summary written to import.json."""
    t0 = time.perf_counter()
    folder, output = Path(folder), Path(output)
    cfg, quant, skipped = model_config_from_release(read_release_config(folder), ignore,
                                                    overrides)
    tok_dir = _tokenizer_folder(folder, tokenizer, cfg)
    reader = ReleaseReader(folder, cfg)
    reader.read_metadata()  # checks every name and shape before anything is written
    meta, counts = reader.meta, reader.counts

    summary = {"source": str(folder.resolve()), "model_config": cfg.to_dict(),
               "skipped_fields": skipped, **counts,
               "quantization": (quant or {}).get("format"),
               "tokenizer": str(tok_dir) if tok_dir else None}
    rank = dist.get_rank()
    Checkpointer(output / "checkpoints", keep=1, rank=rank).save_weights(
        0, meta, {"model_config": cfg.to_dict(), "source": str(folder.resolve()),
                  "tokens_seen": 0}, planner=_LazyPlanner(reader.read_slice))
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                                    3)
    if rank == 0:
        if tok_dir is not None:
            (output / "tokenizer").mkdir(exist_ok=True)
            for f in TOKENIZER_FILES:
                if (tok_dir / f).is_file():
                    shutil.copy2(tok_dir / f, output / "tokenizer" / f)
        (output / "import.json").write_text(json.dumps(summary, indent=1) + "\n")
        if skipped:
            log(f"skipped config fields that change no weight: {', '.join(skipped)}")
    return summary


def _tokenizer_folder(folder: Path, tokenizer: str | None, cfg: ModelConfig) -> Path | None:
    """The tokenizer to copy into the run directory, after checking it fits the vocabulary."""
    from data.tokenizer import load_tokenizer

    if tokenizer in (None, "none"):
        return None
    if tokenizer == "auto":
        if not any((folder / f).is_file() for f in ("tiktoken.model", "tokenizer.json")):
            return None
        tokenizer = str(folder)
    path = Path(tokenizer)
    try:
        tok = load_tokenizer(path)
    except ValueError as e:
        raise ImportHFError(f"--tokenizer: {e}") from None
    if tok.vocab_size > cfg.vocab_size:
        raise ImportHFError(f"tokenizer {str(path)!r} has {tok.vocab_size} ids but the model's "
                            f"vocab_size is {cfg.vocab_size}; pass the checkpoint's own "
                            "tokenizer (or --tokenizer none)")
    return path if path.is_dir() else path.parent


# ------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.checkpoint.import_hf",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="Hugging Face checkpoint folder (config.json, "
                   "safetensors)")
    p.add_argument("--output", type=Path, required=True, help="run directory to create")
    p.add_argument("--tokenizer", default="auto", help="tokenizer folder or file to copy into "
                   "RUN_DIR/tokenizer (default: the checkpoint's, if it has one; none: skip)")
    p.add_argument("--ignore-field", action="append", default=[], metavar="NAME",
                   help="accept this unknown config.json field (one that changes no weight)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("overrides", nargs="*", metavar="model.FIELD=VALUE",
                   help="fields that change no weight, e.g. model.kda_chunk_size=64")
    args = p.parse_intermixed_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    created = False
    try:
        overrides = parse_model_overrides(args.overrides)
        out = args.output
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            if not args.overwrite:
                raise ImportHFError(f"{out} already exists; pass --overwrite to replace it")
        _init_group()
        if rank == 0 and out.exists() and args.overwrite:
            shutil.rmtree(out)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        created = True
        dist.barrier()
        summary = import_hf(args.source, out, args.tokenizer, tuple(args.ignore_field),
                            overrides, log=print if rank == 0 else lambda m: None)
    except (ImportHFError, ConfigError, OSError, ValueError, CheckpointException) as e:
        if rank == 0:
            print(f"import_hf: error: {_first_line(root_cause(e))}", file=sys.stderr)
            if created:
                shutil.rmtree(args.output, ignore_errors=True)  # nothing half-written stays
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"imported {args.source} -> {out}/checkpoints/step-00000000: "
              f"{summary['tensors']} tensors ({summary['mxfp4']} MXFP4 dequantised, "
              f"{summary['skipped_vision']} vision skipped) in {summary['seconds']} s, peak "
              f"RSS {summary['peak_rss_gib']} GiB (rank 0)\n"
              f"continue with: torchrun ... launch/pretrain.py +cluster=<name> run.dir={out} "
              "data=prepared data.dataset=<corpus>"
              + (f" data.tokenizer={out}/tokenizer" if summary["tokenizer"] else ""))
    return 0


def _init_group() -> None:
    """torchrun's group, or a group of one (DCP and the checksums use collectives)."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


if __name__ == "__main__":
    sys.exit(main())

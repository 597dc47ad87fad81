"""Import Kimi K3 from Hugging Face safetensors (K3's release, or our own export) as a run
directory that `launch/pretrain.py` continues in any layout.

    python -m train.import_hf HF_DIR --output RUN_DIR [--tokenizer DIR|none]
        [--ignore-field NAME ...] [--overwrite] [model.FIELD=VALUE ...]
    torchrun --nproc_per_node=N -m train.import_hf ...      # N ranks write a share each
    torchrun ... launch/pretrain.py +cluster=<name> run.dir=RUN_DIR data=... [overrides]

Reads `config.json`: `text_config` onto `ModelConfig` (K3's field names are ours;
`linear_attn_config` holds the KDA fields; our export's `k3train.training_fields` too). Fields
known to change no weight (`vision_config`, inference-only ones: `IGNORED_TOP`, `IGNORED_TEXT`)
are skipped and logged; any other unknown field is a one-line error (`--ignore-field NAME`
accepts it). `quantization_config` must be compressed-tensors `mxfp4-pack-quantized` (K3's
routed experts: E2M1 codes, one E8M0 scale per 32, `model.ops.mxfp4`) or absent.

Reads the safetensors index and shards: every `language_model.*` tensor, renamed as
`train.export_hf` names it (per-expert tensors stacked back into [E, out, in]); vision and
projector tensors are skipped and counted; `<name>.weight_packed` + `weight_scale` pairs are
dequantised exactly into float32. Every name and shape is checked against the model before
anything is written.

Writes `RUN_DIR/checkpoints/step-00000000/`, a model-only checkpoint (`Checkpointer.save_weights`,
checksums included): the trainer loads it into any layout with a fresh optimizer, schedule and
data order, router biases from the checkpoint, Quantile-Balancing statistics empty. Also
`RUN_DIR/tokenizer/` (a copy of the checkpoint's tokenizer files, for `data.tokenizer=`) and
`RUN_DIR/import.json` (what was read and skipped). On an error nothing stays behind.

Streaming: DCP plans the save over meta tensors and `_LazyPlanner` reads (and dequantises) each
tensor from its shard only when DCP writes it, so the peak memory is about the largest tensor
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
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from model.config import ConfigError, ModelConfig
from model.decoder import K3Model
from model.inspect import parse_model_overrides
from model.ops.mxfp4 import GROUP, MXFP4Error, dequantize_mxfp4
from train.checkpoint import Checkpointer, root_cause
from train.export_hf import (
    _LINEAR,
    INDEX,
    SKIPPED,
    ExportError,
    _mtp_copies,
    layer_as_mtp,
    our_name,
)

TEXT_PREFIX = "language_model."
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


class ImportHFError(Exception):
    """A user-facing problem with the checkpoint or the command; one line."""


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


# --------------------------------------------------------------------------- tensors
class _Shards:
    """Tensors of the checkpoint's safetensors files: shapes from their headers, data read on
    demand (at most `keep` files open: safetensors maps each file)."""

    def __init__(self, folder: Path, keep: int = 4) -> None:
        self.folder, self.keep = folder, keep
        self._open: OrderedDict[str, Any] = OrderedDict()

    def handle(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            path = self.folder / file
            if not path.is_file():
                raise ImportHFError(f"{path} is missing (named by {INDEX})")
            try:
                self._open[file] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ImportHFError(f"{path} is not a safetensors file ({_first_line(e)})"
                                    ) from None
            while len(self._open) > self.keep:
                self._open.popitem(last=False)
        self._open.move_to_end(file)
        return self._open[file]

    def scan(self, files: list[str]) -> None:
        """Read the shapes of every tensor of `files` (each header once)."""
        self._shapes: dict[tuple[str, str], list[int]] = {}
        for file in dict.fromkeys(files):
            f = self.handle(file)
            for name in f.keys():
                self._shapes[file, name] = list(f.get_slice(name).get_shape())

    def shape(self, file: str, name: str) -> list[int]:
        if (file, name) not in self._shapes:
            raise ImportHFError(f"{self.folder / file} has no tensor {name!r} ({INDEX} says it "
                                "does)")
        return self._shapes[file, name]

    def read(self, file: str, name: str) -> torch.Tensor:
        return self.handle(file).get_tensor(name)

    def names(self, file: str) -> list[str]:
        return list(self.handle(file).keys())


def _weight_map(folder: Path, shards: _Shards) -> dict[str, str]:
    index = folder / INDEX
    if index.is_file():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ImportHFError(f"{index} is not a safetensors index (needs weight_map)"
                                ) from None
    if (folder / "model.safetensors").is_file():
        return dict.fromkeys(shards.names("model.safetensors"), "model.safetensors")
    raise ImportHFError(f"{folder} has neither {INDEX} nor model.safetensors")


@dataclasses.dataclass
class _Source:
    """Where one of our tensors comes from: per expert (or one entry), {kind: (file, name)}
    with kind "plain", or "packed" + "scale" (MXFP4)."""

    parts: dict[int | None, dict[str, tuple[str, str]]] = dataclasses.field(default_factory=dict)

    def add(self, expert: int | None, kind: str, file: str, name: str) -> None:
        self.parts.setdefault(expert, {})[kind] = (file, name)


def plan_sources(folder: Path, cfg: ModelConfig, meta: dict[str, torch.Tensor],
                 shards: _Shards) -> tuple[dict[str, _Source], dict[str, int]]:
    """Our tensor name -> its source, after checking names and shapes against the model;
    and counts of what was skipped or dequantised."""
    L = cfg.num_hidden_layers
    copies = _mtp_copies(L)
    counts = {"tensors": 0, "skipped_vision": 0, "skipped_mtp_copies": 0, "mxfp4": 0}
    sources: dict[str, _Source] = {}
    weight_map = _weight_map(folder, shards)
    shards.scan(list(weight_map.values()))
    for name, file in weight_map.items():
        if not name.startswith(TEXT_PREFIX):
            counts["skipped_vision"] += 1
            continue
        if name in copies:
            counts["skipped_mtp_copies"] += 1
            continue
        base, kind = name, "plain"
        for suffix, k in (("_packed", "packed"), ("_scale", "scale"), ("_shape", "shape")):
            if name.endswith(".weight" + suffix):
                base, kind = name.removesuffix(suffix), k
        if kind == "shape":  # compressed-tensors' logical shape; checked through the scale
            continue
        try:
            ours, expert = our_name(base)
        except ExportError as e:
            raise ImportHFError(str(e)) from None
        sources.setdefault(layer_as_mtp(ours, L), _Source()).add(expert, kind, file, name)
        counts["tensors"] += 1
    expected = {k: v for k, v in meta.items() if k.rsplit(".", 1)[-1] not in SKIPPED}
    extra = sorted(set(sources) - set(expected))
    if extra:
        raise ImportHFError(f"tensor {extra[0]!r} ({len(extra)} such) has no place in the model "
                            "config.json describes; is the checkpoint another model?")
    missing = sorted(set(expected) - set(sources))
    if missing:
        raise ImportHFError(f"the checkpoint lacks {missing[0]!r} ({len(missing)} missing "
                            "tensors); is a shard or an MTP layer missing?")
    for ours, src in sources.items():
        counts["mxfp4"] += _check_shapes(ours, src, list(expected[ours].shape), shards)
    return sources, counts


def _check_shapes(ours: str, src: _Source, shape: list[int], shards: _Shards) -> int:
    """Raise on a shape that does not fit; return how many MXFP4 tensors it holds."""
    experts = sorted(e for e in src.parts if e is not None)
    if experts:
        if experts != list(range(shape[0])) or None in src.parts:
            raise ImportHFError(f"{ours}: the checkpoint has experts {experts[:3]}.. "
                                f"({len(experts)}), the model {shape[0]}")
        shape = shape[1:]
    n_mx = 0
    for part in src.parts.values():
        if "plain" in part:
            file, name = part["plain"]
            got = shards.shape(file, name)
            if got != shape:
                raise ImportHFError(f"{name} has shape {got}, the model needs {shape} ({ours})")
            continue
        if set(part) != {"packed", "scale"}:
            name = next(iter(part.values()))[1]
            raise ImportHFError(f"{name}: an MXFP4 weight needs both weight_packed and "
                                "weight_scale")
        want = {"packed": [*shape[:-1], shape[-1] // 2],
                "scale": [*shape[:-1], shape[-1] // GROUP]}
        for kind, (file, name) in part.items():
            got = shards.shape(file, name)
            if got != want[kind] or shape[-1] % GROUP:
                raise ImportHFError(f"{name} has shape {got}, the model's {shape} needs "
                                    f"{want[kind]} ({ours})")
        n_mx += 1
    return n_mx


class _LazyPlanner(DefaultSavePlanner):
    """Plans over meta tensors; hands DCP each real tensor only when it writes it."""

    def __init__(self, load) -> None:
        super().__init__()
        self._load = load

    def lookup_object(self, index):
        return self._load(index.fqn.removeprefix("model."))


def _materialise(src: _Source, meta: torch.Tensor, shards: _Shards) -> torch.Tensor:
    def one(part: dict[str, tuple[str, str]]) -> torch.Tensor:
        if "plain" in part:
            return shards.read(*part["plain"]).to(meta.dtype)
        try:
            return dequantize_mxfp4(shards.read(*part["packed"]), shards.read(*part["scale"]),
                                    meta.dtype)
        except MXFP4Error as e:
            raise ImportHFError(f"{part['packed'][1]}: {e}") from None

    if None in src.parts:
        return one(src.parts[None]).contiguous()
    out = torch.empty(meta.shape, dtype=meta.dtype)
    for e, part in src.parts.items():
        out[e].copy_(one(part))
    return out


# ---------------------------------------------------------------------------- import
def import_hf(folder: Path, output: Path, tokenizer: str | None = "auto",
              ignore: tuple[str, ...] = (), overrides: dict[str, Any] | None = None,
              log=print) -> dict[str, Any]:
    """Import `folder` into the run directory `output` (every rank calls, inside a process
    group); returns the summary written to import.json."""
    t0 = time.perf_counter()
    folder, output = Path(folder), Path(output)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ImportHFError(f"{folder / 'config.json'} cannot be read ({_first_line(e)})"
                            ) from None
    cfg, quant, skipped = model_config_from_release(config, ignore, overrides)
    tok_dir = _tokenizer_folder(folder, tokenizer, cfg)
    shards = _Shards(folder)
    meta = K3Model(cfg, device="meta").state_dict()  # our names, shapes and dtypes
    sources, counts = plan_sources(folder, cfg, meta, shards)

    def load(ours: str) -> torch.Tensor:
        if ours.rsplit(".", 1)[-1] in SKIPPED:  # Quantile-Balancing statistics start empty
            return torch.zeros(meta[ours].shape, dtype=meta[ours].dtype)
        return _materialise(sources[ours], meta[ours], shards)

    summary = {"source": str(folder.resolve()), "model_config": cfg.to_dict(),
               "skipped_fields": skipped, **counts,
               "quantization": (quant or {}).get("format"),
               "tokenizer": str(tok_dir) if tok_dir else None}
    rank = dist.get_rank()
    Checkpointer(output / "checkpoints", keep=1, rank=rank).save_weights(
        0, meta, {"model_config": cfg.to_dict(), "source": str(folder.resolve()),
                  "tokens_seen": 0}, planner=_LazyPlanner(load))
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.import_hf", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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

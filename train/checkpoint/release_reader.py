"""K3's Hugging Face release (or our own export) as a DCP storage reader in our tensor names.

    cfg, _, _ =
    train.checkpoint.import_hf.model_config_from_release(json.load(open(HF_DIR/config.json)))
    dcp.load(model_state_dict, storage_reader=ReleaseReader(HF_DIR, cfg))  # any layout
    load_release(model, HF_DIR, cfg)      # the same for a (sharded) nn.Module, in place

`ReleaseReader` is torch's `HuggingFaceStorageReader` (DCP, torch >= 2.8; feature-tested at
construction) with our names on top. Its `read_metadata` reads every safetensors header once
(torch's), checks every name and shape against `K3Model(cfg)`, and presents one full-size chunk per
tensor of ours in the model's dtype; `read_data` serves any slice DCP asks for (a DTensor's local
shard: FSDP rows, TP columns, EP experts) by reading only that slice of the source: safetensors
slices of the bf16 tensors, of each expert's [out, in] matrix for a stacked [E, out, in] weight,
and for MXFP4 experts (compressed-tensors `weight_packed` + `weight_scale`) the 32-column groups
covering the slice, dequantised exactly (`model.ops.mxfp4`). Vision tensors and the MTP layer's
copies of the embedding and head are skipped; Quantile-Balancing statistics read as zeros.

torch's `QuantizedHuggingFaceStorageReader` dequantises gpt-oss MXFP4 (`_blocks`/`_scales`) and
block-FP8 (`weight_scale_inv`) only, not compressed-tensors' names, so it cannot read K3's experts.
`train.checkpoint.import_hf` uses `read_slice` for whole tensors when it writes a step-0 checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

from model.config import ModelConfig
from model.decoder import K3Model
from model.ops.mxfp4 import GROUP, MXFP4Error, dequantize_mxfp4
from train.checkpoint.export_hf import (
    INDEX,
    SKIPPED,
    ExportError,
    _mtp_copies,
    layer_as_mtp,
    our_name,
)

TEXT_PREFIX = "language_model."

try:  # torch >= 2.8
    from torch.distributed.checkpoint import HuggingFaceStorageReader
except ImportError:  # pragma: no cover - older torch; the constructor says what to install
    HuggingFaceStorageReader = None


class ImportHFError(Exception):
    """A user-facing problem with the checkpoint or the command; one line."""


@dataclasses.dataclass
class _Source:
    """Where one of our tensors comes from: per expert (or one entry), {kind: (file, name)}
    with kind "plain", or "packed" + "scale" (MXFP4)."""

    parts: dict[int | None, dict[str, tuple[str, str]]] = dataclasses.field(default_factory=dict)

    def add(self, expert: int | None, kind: str, file: str, name: str) -> None:
        self.parts.setdefault(expert, {})[kind] = (file, name)


class ReleaseReader(HuggingFaceStorageReader or object):  # type: ignore[misc]
    """A K3 release folder read through DCP, in our names (see the module docstring)."""

    def __init__(self, folder: str | Path, cfg: ModelConfig, keep_open: int = 4) -> None:
        if HuggingFaceStorageReader is None:
            raise ImportHFError(f"torch {torch.__version__} has no torch.distributed.checkpoint."
                                "HuggingFaceStorageReader; reading a Hugging Face checkpoint "
                                "needs torch>=2.8 (pip install 'torch>=2.11')")
        super().__init__(str(folder))
        self.folder, self.cfg, self.keep_open = Path(folder), cfg, keep_open
        self.meta = K3Model(cfg, device="meta").state_dict()  # our names, shapes and dtypes
        self.sources: dict[str, _Source] = {}
        self.counts: dict[str, int] = {}
        self._ours: Metadata | None = None
        self._open: OrderedDict[str, Any] = OrderedDict()
        self.bytes_read = 0  # from the safetensors files, as stored (bf16, packed codes)

    # ----------------------------------------------------------------------- metadata
    def read_metadata(self) -> Metadata:
        if self._ours is None:
            self._ours = self._plan()
        self._ours.storage_meta = StorageMeta(load_id=self.load_id)
        return self._ours

    def _plan(self) -> Metadata:
        index = self._index()
        for file in sorted(set(index.values()) if index else ()):
            if not (self.folder / file).is_file():
                raise ImportHFError(f"{self.folder / file} is missing (named by {INDEX})")
        try:
            hf = super().read_metadata()  # every header, once: names, shapes, dtypes, files
        except Exception as e:
            raise self._bad_file(e) from None
        where = {i.fqn: Path(info.relative_path).name for i, info in hf.storage_data.items()}
        shapes = {k: list(md.size) for k, md in hf.state_dict_metadata.items()}
        if index is None:
            if not (self.folder / "model.safetensors").is_file():
                raise ImportHFError(f"{self.folder} has neither {INDEX} nor model.safetensors")
            index = {k: f for k, f in where.items() if f == "model.safetensors"}
        for name, file in index.items():
            if name not in where:
                raise ImportHFError(f"{self.folder / file} has no tensor {name!r} ({INDEX} says "
                                    "it does)")
        self.sources, self.counts = plan_sources(self.cfg, self.meta,
                                                 {n: where[n] for n in index}, shapes)
        chunks, storage = {}, {}
        for ours, t in self.meta.items():
            zero = torch.Size([0] * t.dim())
            chunks[ours] = TensorStorageMetadata(
                properties=TensorProperties(dtype=t.dtype), size=t.shape,
                chunks=[ChunkStorageMetadata(offsets=zero, sizes=t.shape)])
            storage[MetadataIndex(ours, zero)] = ours
        return Metadata(state_dict_metadata=chunks, storage_data=storage)

    def _index(self) -> dict[str, str] | None:
        path = self.folder / INDEX
        if not path.is_file():
            return None
        try:
            return dict(json.loads(path.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError):
            raise ImportHFError(f"{path} is not a safetensors index (needs weight_map)"
                                ) from None

    def _bad_file(self, e: BaseException) -> ImportHFError:
        """Name the file torch's header scan failed on (it does not say)."""
        from safetensors import safe_open

        for path in sorted(self.folder.glob("*.safetensors")):
            try:
                with safe_open(str(path), framework="pt"):
                    pass
            except Exception as bad:  # safetensors raises its own error types
                return ImportHFError(f"{path} is not a safetensors file ({_first_line(bad)})")
        return ImportHFError(f"{self.folder}: cannot read the safetensors headers "
                             f"({_first_line(e)})")

    # --------------------------------------------------------------------------- data
    def read_data(self, plan, planner) -> Future:
        for item in plan.items:
            tensor = self.read_slice(item.storage_index.fqn, list(item.storage_offsets),
                                     list(item.lengths))
            target = planner.resolve_tensor(item).detach()
            if target.shape != tensor.shape:
                raise AssertionError(f"{item.storage_index.fqn}: DCP asked for "
                                     f"{list(target.shape)}, read {list(tensor.shape)}")
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def read_slice(self, ours: str, offsets: list[int] | None = None,
                   lengths: list[int] | None = None) -> torch.Tensor:
        """offsets[d]:offsets[d] + lengths[d] of our tensor `ours` (default: all of it), in the
        model's dtype, reading only that slice of the source."""
        if self._ours is None:
            self.read_metadata()
        meta = self.meta[ours]
        offsets = [0] * meta.dim() if offsets is None else offsets
        lengths = list(meta.shape) if lengths is None else lengths
        if ours.rsplit(".", 1)[-1] in SKIPPED:  # Quantile-Balancing statistics start empty
            return torch.zeros(lengths, dtype=meta.dtype)
        parts = self.sources[ours].parts
        if None in parts:
            return self._part(parts[None], offsets, lengths, meta.dtype)
        out = torch.empty(lengths, dtype=meta.dtype)
        for i in range(lengths[0]):  # experts of a stacked [E, out, in] weight: I/O, not compute
            out[i].copy_(self._part(parts[offsets[0] + i], offsets[1:], lengths[1:], meta.dtype))
        return out

    def _part(self, part: dict[str, tuple[str, str]], offsets: list[int], lengths: list[int],
              dtype: torch.dtype) -> torch.Tensor:
        rows = [slice(o, o + n) for o, n in zip(offsets[:-1], lengths[:-1])]
        if "plain" in part:
            cols = [slice(offsets[-1], offsets[-1] + lengths[-1])] if offsets else []
            return self._get(*part["plain"], rows + cols).to(dtype)
        c0, c1 = offsets[-1], offsets[-1] + lengths[-1]
        g0, g1 = c0 // GROUP, -(-c1 // GROUP)  # the 32-column groups covering the slice
        packed = self._get(*part["packed"], [*rows, slice(g0 * GROUP // 2, g1 * GROUP // 2)])
        scale = self._get(*part["scale"], [*rows, slice(g0, g1)])
        try:
            values = dequantize_mxfp4(packed, scale, dtype)
        except MXFP4Error as e:
            raise ImportHFError(f"{part['packed'][1]}: {e}") from None
        return values[..., c0 - g0 * GROUP:c1 - g0 * GROUP]

    def _get(self, file: str, name: str, slices: list[slice]) -> torch.Tensor:
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
            while len(self._open) > self.keep_open:
                self._open.popitem(last=False)
        self._open.move_to_end(file)
        f = self._open[file]
        t = f.get_slice(name)[tuple(slices)] if slices else f.get_tensor(name)
        self.bytes_read += t.nbytes
        return t


def load_release(model: torch.nn.Module, folder: str | Path, cfg: ModelConfig
                 ) -> ReleaseReader:
    """Load the release into `model` in place, whatever its layout (FSDP, TP, EP DTensors or a
    pipeline stage's part): every rank calls; each reads only its own shards. Returns the
    reader (`bytes_read`: what this rank read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state = get_model_state_dict(model)
    reader = ReleaseReader(folder, cfg)
    dcp.load(state, storage_reader=reader)
    set_model_state_dict(model, state, options=StateDictOptions(strict=True))
    return reader


# ------------------------------------------------------------------ names and shapes
def plan_sources(cfg: ModelConfig, meta: dict[str, torch.Tensor], files: dict[str, str],
                 shapes: dict[str, list[int]]) -> tuple[dict[str, _Source], dict[str, int]]:
    """Our tensor name -> its source, after checking names and shapes against the model;
    and counts of what was skipped or dequantised. `files`: HF name -> file; `shapes`: HF
    name -> shape."""
    L = cfg.num_hidden_layers
    copies = _mtp_copies(L)
    counts = {"tensors": 0, "skipped_vision": 0, "skipped_mtp_copies": 0, "mxfp4": 0}
    sources: dict[str, _Source] = {}
    for name, file in files.items():
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
        counts["mxfp4"] += _check_shapes(ours, src, list(expected[ours].shape), shapes)
    return sources, counts


def _check_shapes(ours: str, src: _Source, shape: list[int], shapes: dict[str, list[int]]
                  ) -> int:
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
            name = part["plain"][1]
            if shapes[name] != shape:
                raise ImportHFError(f"{name} has shape {shapes[name]}, the model needs {shape} "
                                    f"({ours})")
            continue
        if set(part) != {"packed", "scale"}:
            name = next(iter(part.values()))[1]
            raise ImportHFError(f"{name}: an MXFP4 weight needs both weight_packed and "
                                "weight_scale")
        want = {"packed": [*shape[:-1], shape[-1] // 2],
                "scale": [*shape[:-1], shape[-1] // GROUP]}
        for kind, (_, name) in part.items():
            if shapes[name] != want[kind] or shape[-1] % GROUP:
                raise ImportHFError(f"{name} has shape {shapes[name]}, the model's {shape} needs "
                                    f"{want[kind]} ({ours})")
        n_mx += 1
    return n_mx


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__

"""A synthetic checkpoint in Kimi K3's release layout, written from a model built by the test.

What the release has (k3-architecture.md §6.6, §7.1): `config.json` with `text_config`
(kimi_linear), `vision_config` and a compressed-tensors `quantization_config`
(`mxfp4-pack-quantized`, group 32); bf16 text tensors under `language_model.*` (router biases
and the tensors K3 keeps in fp32 stay fp32); every routed expert's w1/w2/w3 as `weight_packed`
uint8 [out, in/2] + `weight_scale` uint8 [out, in/32] + `weight_shape`; vision tensors; several
shards and an index; a tiktoken tokenizer with Kimi's special tokens. The expert codes and
scales are random, and the model's own expert weights are replaced by their dequantisation
through the `compressed-tensors` package (not our decoder), so the imported model must equal
the returned one exactly.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.decoder import K3Model
from train.checkpoint.export_hf import INDEX, hf_config, hf_tensors, keeps_fp32_hf

EXPERT = re.compile(r"^(language_model\.model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\."
                    r"(w[123])\.weight$")
QUANT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "quantization_status": "compressed",
         "config_groups": {"group_0": {
             "targets": ["Linear"], "format": "mxfp4-pack-quantized",
             "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                         "group_size": 32, "dynamic": False, "scale_dtype": "torch.uint8"},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                   "group_size": 32, "dynamic": True}}},
         "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                    "re:.*vision_tower.*", "lm_head"]}
VISION = {"vision_tower.patch_embed.proj.weight": (16, 3, 14, 14),
          "vision_tower.encoder.blocks.0.mlp.fc0.weight": (32, 16),
          "multi_modal_projector.linear_1.weight": (64, 64)}


def ct_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own unpacking of its mxfp4-pack-quantized format (bf16 -> float32)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], format="mxfp4-pack-quantized",
                                weights=QuantizationArgs(num_bits=4, type="float",
                                                         strategy="group", group_size=32,
                                                         symmetric=True,
                                                         scale_dtype=torch.uint8))
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    return compressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                 scheme)["weight"]


def as_release(model: K3Model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Make `model` what a release of it holds (bf16-rounded text tensors except the fp32 ones,
    MXFP4 experts) and return the release's tensors by HF name."""
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if t.is_floating_point() and not keeps_fp32_hf(name):
                t.copy_(t.to(torch.bfloat16).float())
    out: dict[str, torch.Tensor] = {}
    for hf, t, dtype in hf_tensors(state, torch.bfloat16, model.config):
        m = EXPERT.match(hf)
        if not m:
            out[hf] = t.to(dtype).contiguous()
            continue
        rows, cols = t.shape
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        scale = torch.randint(118, 124, (rows, cols // 32), dtype=torch.uint8, generator=g)
        with torch.no_grad():
            t.copy_(ct_dequantize(packed, scale).float())  # a view of the stacked expert weight
        base = hf.removesuffix(".weight")
        out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = packed, scale
        out[f"{base}.weight_shape"] = torch.tensor([rows, cols])
    for name, shape in VISION.items():
        out[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
    return out


def write_release(model: K3Model, folder: Path, shards: int = 3, seed: int = 0) -> Path:
    """Write `model` as K3's release would ship it (changing `model` to match); returns folder."""
    folder.mkdir(parents=True)
    tensors = as_release(model, seed)
    config = hf_config(model.config, torch.bfloat16, 0, folder)
    config.pop("k3train")  # the release carries none of our provenance
    config.update({"vision_config": {"patch_size": 14, "vt_hidden_size": 16},
                   "media_placeholder_token_id": 163605, "quantization_config": QUANT,
                   "transformers_version": "4.57.1",
                   "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config"}})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    names = list(tensors)
    per = -(-len(names) // shards)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, f in enumerate(files):
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(folder / f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, f))
    total = sum(t.nbytes for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": weight_map}, indent=1))
    write_tiktoken(folder, model.config.vocab_size - 256)
    return folder


def write_tiktoken(folder: Path, base: int = 256) -> None:
    """A Kimi-style tiktoken tokenizer: `base` tokens (bytes, then merges of two bytes) and 256
    special ids after them, [BOS] and [EOS] first."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [bytes([97 + i % 26, 97 + i // 26]) for i in range(base - 256)]
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(base): {"content": "[BOS]", "special": True},
                                 str(base + 1): {"content": "[EOS]", "special": True}},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer"}))

"""Time and peak memory of `train.checkpoint.import_hf` on a synthetic K3-release checkpoint; one
JSON line.

    python benchmarks/import_k3_cpu.py [--model k3_small] [--nproc 1] [--workdir DIR] [--keep]

Writes a checkpoint in K3's release layout for the model preset (random bf16 text tensors,
random MXFP4 codes and scales for every routed expert, 5 GB shards, an index; tensor by tensor,
never the whole model), then imports it with `python -m train.checkpoint.import_hf` (`--nproc`
> 1: under torchrun) and reports the import's wall time, the peak RSS of the largest import process
(`RUSAGE_CHILDREN`, which includes the pages of the safetensors files it mapped) and the sizes
on disk. k3_small: 4.25B parameters, a 4.4 GB release, a 17 GB float32 checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from model.config import load_model_config  # noqa: E402
from model.decoder import K3Model  # noqa: E402
from train.checkpoint.export_hf import INDEX, hf_config, hf_tensors  # noqa: E402

EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
QUANT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                       "weights": {"num_bits": 4, "type": "float",
                                                   "group_size": 32, "strategy": "group"}}}}


def write_release(model: str, folder: Path, shard_bytes: float = 5e9) -> tuple[int, int]:
    """(parameters, bytes) of a synthetic release of `model` written to `folder`."""
    cfg = load_model_config(model)
    meta = K3Model(cfg, device="meta").state_dict()
    folder.mkdir(parents=True)
    config = hf_config(cfg, torch.bfloat16, 0, folder)
    config.pop("k3train")
    config["quantization_config"] = QUANT
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(0)
    weight_map, shard, size, total, params, n = {}, {}, 0, 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

    for hf, t, dtype in hf_tensors(meta, torch.bfloat16, cfg):
        params += t.numel()
        if EXPERT.search(hf):
            rows, cols = t.shape
            base = hf.removesuffix(".weight")
            parts = {f"{base}.weight_packed": torch.randint(0, 256, (rows, cols // 2),
                                                            dtype=torch.uint8, generator=g),
                     f"{base}.weight_scale": torch.randint(118, 124, (rows, cols // 32),
                                                           dtype=torch.uint8, generator=g)}
        elif dtype.is_floating_point:
            parts = {hf: (torch.randn(t.shape, generator=g) * 0.02).to(dtype)}
        else:
            parts = {hf: torch.zeros(t.shape, dtype=dtype)}
        for k, v in parts.items():
            if size + v.nbytes > shard_bytes:
                flush()
            shard[k], size = v, size + v.nbytes
            total += v.nbytes
    flush()
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": weight_map}))
    return params, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3_small")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the release and the run")
    args = ap.parse_args()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        t0 = time.perf_counter()
        params, release_bytes = write_release(args.model, work / "release")
        written_s = time.perf_counter() - t0
        head = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={args.nproc}", "-m"] if args.nproc > 1
                else [sys.executable, "-m"])
        t0 = time.perf_counter()
        r = subprocess.run([*head, "train.checkpoint.import_hf", str(work / "release"), "--output",
                            str(work / "run")], cwd=ROOT, capture_output=True, text=True)
        import_s = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"import failed:\n{r.stderr[-3000:]}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        ckpt = work / "run" / "checkpoints" / "step-00000000"
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.iterdir())
        print(json.dumps({"bench": "import_k3_cpu", "model": args.model, "nproc": args.nproc,
                          "params": params, "release_gb": round(release_bytes / 1e9, 2),
                          "checkpoint_gb": round(ckpt_bytes / 1e9, 2),
                          "release_written_s": round(written_s, 1),
                          "import_s": round(import_s, 1),
                          "peak_rss_gib": round(peak, 2)}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

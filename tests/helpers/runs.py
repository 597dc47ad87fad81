"""Run `launch/pretrain.py` the way a user does (torchrun for several ranks) and read its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A small, fast job: debug model, short sequences, a small slice of the default corpus.
FAST = ["data.seq_len=64", "data.global_batch=8", "data.micro_batch=2",
        "data.stdlib_max_bytes=2000000", "metrics.wandb_mode=disabled",
        "train.log_images_every=0", "train.log_sample_ids=true"]


def pretrain(run_dir: Path, *overrides: str, nproc: int = 1, env: dict | None = None,
             timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}"]
    else:
        cmd = [sys.executable]
    cmd += [str(ROOT / "launch" / "pretrain.py"), "+cluster=local_cpu", f"run.dir={run_dir}",
            *FAST, *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    r = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"pretrain failed ({r.returncode}):\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-5000:]}")
    return r


def pretrain_many(jobs: list[tuple[Path, list[str]]], nproc: int, timeout: int = 900,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """Train several (run_dir, overrides) jobs one after another in a single `nproc`-rank
    launch (`tests/helpers/multirun.py`: start-up paid once); rank 0's console output of each
    job is in `<run_dir>.stdout`. Each job is the `pretrain(run_dir, *overrides)` it replaces."""
    import tempfile

    jobs_json = [[str(d), ["+cluster=local_cpu", f"run.dir={d}", *FAST, *o]] for d, o in jobs]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs_json, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ROOT / "tests" / "helpers" / "multirun.py"), f.name]
    if nproc == 1:
        cmd = [sys.executable, *cmd[-2:]]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                       capture_output=True, text=True, timeout=timeout)
    os.unlink(f.name)
    if r.returncode != 0:
        raise AssertionError(f"pretrain_many failed ({r.returncode}):\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-5000:]}")
    return r


def pretrain_concurrently(*jobs: tuple) -> list[subprocess.CompletedProcess]:
    """Run several `pretrain(run_dir, *overrides, **kw)` jobs, given as (run_dir, overrides,
    kw), at the same time: single-rank runs use one core each (OMP_NUM_THREADS=1), and
    interpreter start-up dominates short launches, so two or more together finish sooner."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(pretrain, d, *o, **(kw[0] if kw else {})) for d, o, *kw in jobs]
    return [f.result() for f in futures]


def close(got: float, ref: float, rel: float) -> bool:
    """|got - ref| <= rel |ref|: the layout tests' relative bound on per-step figures."""
    return abs(got - ref) <= rel * abs(ref)


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir)}


def sample_ids(run_dir: Path) -> dict[int, list[int]]:
    return {m["step"]: m["sample_ids"] for m in metrics(run_dir)}


def assert_parameters_equal(ref_dir: Path, got_dir: Path, step: int) -> list[str]:
    """The floating-point state of two runs' step-`step` checkpoints agrees to fp32 round-off
    (rtol 1e-5, atol 1e-6, for fp64 verification runs); returns the names compared."""
    import torch

    from train.checkpoint.export_hf import load_model

    name = f"step-{step:08d}"
    ref, _ = load_model(ref_dir / "checkpoints" / name)
    got, _ = load_model(got_dir / "checkpoints" / name)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    compared = []
    for k, v in ref_sd.items():
        if v.is_floating_point():
            torch.testing.assert_close(got_sd[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"{got_dir.name} {k}: {m}")
            compared.append(k)
    return compared

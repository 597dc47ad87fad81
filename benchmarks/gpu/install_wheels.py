"""Suite step "install": put the wheels of `.gpu_wheels/` that this Python lacks into a folder.

    python benchmarks/gpu/install_wheels.py WHEEL_DIR TARGET

Offline: `pip install --no-index --no-deps --target TARGET` (or, without pip, plain extraction:
these wheels are all pure Python or one platlib tree) of each wheel whose module does not import
here; the suite then puts TARGET first on PYTHONPATH, so nothing installed system-wide changes
and a module the machine already has is never shadowed (except antlr4 other than 4.9.x, which
OmegaConf cannot use). fla is then checked in a child process (`from fla.ops.kda import
chunk_kda`); if it fails, flash-linear-attention's fla.layers / fla.models are dropped, then
fla-core falls back to WHEEL_DIR/alt/. Prints one JSON line ("stage": "install").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# wheel file prefix -> module it provides (installed only when the module is missing)
WHEELS = {"einops": "einops", "packaging": "packaging", "hydra_core": "hydra",
          "omegaconf": "omegaconf", "antlr4_python3_runtime": "antlr4", "pyyaml": "yaml",
          "rich": "rich", "markdown_it_py": "markdown_it", "mdurl": "mdurl",
          "pygments": "pygments", "numpy": "numpy"}
FLA = ("fla_core", "flash_linear_attention")
CHECK_FLA = "import fla; from fla.ops.kda import chunk_kda; print(fla.__version__)"


def wheel(folder: Path, prefix: str) -> Path | None:
    found = sorted(folder.glob(f"{prefix}-*.whl"))
    return found[-1] if found else None


def present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def needs(prefix: str, module: str) -> bool:
    if prefix == "antlr4_python3_runtime" and present(module):
        try:  # OmegaConf 2.3 parses with the 4.9 runtime only
            return not importlib.metadata.version("antlr4-python3-runtime").startswith("4.9")
        except importlib.metadata.PackageNotFoundError:
            return False
    return not present(module)


def extract(whl: Path, target: Path) -> None:
    """Install a wheel by unpacking it (purelib/platlib of `*.data/` moved to the root)."""
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts / headers / data: not needed to import
                name = "/".join(parts[2:])
            dest = target / name
            if info.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, dest.open("wb") as dst:
                shutil.copyfileobj(src, dst)


def install(wheels: list[Path], target: Path, log: dict) -> None:
    if not wheels:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--no-compile", "--target", str(target),
           *map(str, wheels)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        log.setdefault("method", []).append("pip")
        return
    log.setdefault("pip_error", []).append(" ".join(r.stderr.split())[-400:])
    for w in wheels:
        extract(w, target)
    log.setdefault("method", []).append("unzip")


def check_fla(target: Path) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(target), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        r = subprocess.run([sys.executable, "-c", CHECK_FLA], capture_output=True, text=True,
                           env=env, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "import timed out"
    if r.returncode == 0:
        return True, r.stdout.strip()
    return False, " ".join(r.stderr.strip().splitlines()[-1:])[-400:]


def remove_fla(target: Path, models_only: bool) -> None:
    if models_only:
        for sub in ("fla/layers", "fla/models"):
            shutil.rmtree(target / sub, ignore_errors=True)
        for d in target.glob("flash_linear_attention-*.dist-info"):
            shutil.rmtree(d, ignore_errors=True)
        return
    shutil.rmtree(target / "fla", ignore_errors=True)
    for prefix in FLA:
        for d in target.glob(f"{prefix}-*.dist-info"):
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    t0 = time.monotonic()
    folder, target = Path(sys.argv[1]), Path(sys.argv[2])
    out: dict = {"stage": "install", "ok": False, "wheel_dir": str(folder), "target": str(target)}
    try:
        shutil.rmtree(target, ignore_errors=True)
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != target.resolve()]
        importlib.invalidate_caches()  # judge what the machine has, not a previous install
        target.mkdir(parents=True)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is missing: run `bash benchmarks/gpu_wheels.sh` "
                                    "where a registry is reachable and carry .gpu_wheels along")
        picked, already, absent = [], [], []
        for prefix, module in WHEELS.items():
            if not needs(prefix, module):
                already.append(module)
            elif (w := wheel(folder, prefix)) is None:
                absent.append(prefix)
            else:
                picked.append(w)
        fla_ok, fla_msg = False, ""
        if present("fla"):
            already.append("fla")
        else:
            picked += [w for w in (wheel(folder, p) for p in FLA) if w is not None]
        install(picked, target, out)
        out.update(installed=[w.name for w in picked], already_present=already,
                   wheel_missing=absent)
        fla_ok, fla_msg = check_fla(target)
        out["fla_tries"] = [{"what": "as installed", "ok": fla_ok, "msg": fla_msg}]
        if not fla_ok and "fla" not in already:
            remove_fla(target, models_only=True)
            fla_ok, fla_msg = check_fla(target)
            out["fla_tries"].append({"what": "without flash-linear-attention", "ok": fla_ok,
                                     "msg": fla_msg})
        if not fla_ok and "fla" not in already and (alt := wheel(folder / "alt", "fla_core")):
            remove_fla(target, models_only=False)
            install([alt], target, out)
            fla_ok, fla_msg = check_fla(target)
            out["fla_tries"].append({"what": alt.name, "ok": fla_ok, "msg": fla_msg})
        out["fla_version"] = fla_msg if fla_ok else None
        out["ok"] = fla_ok and not absent
    except Exception as e:  # noqa: BLE001 - the suite goes on without what failed here
        out["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:800]
    out["stage_s"] = round(time.monotonic() - t0, 2)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

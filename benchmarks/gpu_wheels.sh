#!/usr/bin/env bash
# Fetch, on a machine with package-registry access, the wheels the GPU check
# (benchmarks/gpu_suite.sh) installs offline on a Python 3.12 / x86_64 GPU machine that has torch,
# triton, tokenizers and safetensors but not fla, Hydra or OmegaConf.
#
#     bash benchmarks/gpu_wheels.sh          # -> .gpu_wheels/ (ignored by git; ~20 MiB)
#
# Every wheel is downloaded with --no-deps for cp312 / manylinux x86_64, so the pins below are
# the whole dependency closure of what the suite needs beyond torch/triton:
#   fla-core, flash-linear-attention  fla's Triton kernels (0.6.0: needs torch>=2.7, triton>=3.3,
#                                     knows triton 3.6 on Hopper); flash-linear-attention only adds
#                                     fla.layers / fla.models, which are skipped without transformers
#   einops, packaging                 fla-core's own imports
#   hydra-core, omegaconf, antlr4     the launcher's config composition (antlr4 4.9.3 has only an
#                                     sdist: built here into a py3-none-any wheel)
#   pyyaml                            omegaconf's YAML
#   rich (+ markdown-it-py, mdurl, pygments), numpy
#                                     the data pipeline's imports, in case the GPU machine lacks them
# alt/ holds fla-core 0.5.2, which the suite falls back to if 0.6.0 does not import there.
# gpu_suite.sh installs a wheel only when its module does not import already.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.gpu_wheels}"
PY_VER=3.12
FLA_VERSION=0.6.0
FLA_ALT_VERSION=0.5.2

mkdir -p "$DEST/alt"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# A wheel for cp312 / manylinux x86_64 (or py3-none-any), no dependencies resolved.
# numpy 2.x is tagged manylinux_2_27/2_28, hence the second platform (torch itself needs 2.28).
fetch() {
    local dest="$1"
    shift
    pip download --no-deps --only-binary=:all: --python-version "$PY_VER" \
        --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
        --dest "$dest" --quiet "$@"
}

fetch "$DEST" \
    "fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION" \
    "einops==0.8.2" "packaging==26.2" \
    "hydra-core==1.3.8" "omegaconf==2.3.1" "pyyaml==6.0.3" \
    "rich==15.0.0" "markdown-it-py==4.3.0" "mdurl==0.1.2" "pygments==2.20.0" \
    "numpy==2.4.6"
fetch "$DEST/alt" "fla-core==$FLA_ALT_VERSION"

# antlr4-python3-runtime 4.9.x (what omegaconf 2.3 / hydra 1.3 pin): sdist only on the registry.
if ! ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
    pip download --no-deps --no-binary=:all: "antlr4-python3-runtime==4.9.3" \
        --dest "$tmp/sdist" --quiet
    pip wheel --no-deps --wheel-dir "$DEST" --quiet "$tmp"/sdist/antlr4*
fi

# What each fla-core wheel asks for (checked by hand: torch>=2.7, triton>=3.3 for cuda).
for w in "$DEST"/fla_core-*.whl "$DEST"/alt/fla_core-*.whl; do
    python - "$w" <<'EOF'
import sys
import zipfile

path = sys.argv[1]
with zipfile.ZipFile(path) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
            if ln.startswith("Requires-Dist:") and ("cuda" in ln or "extra" not in ln)]
print(f"{path.rsplit('/', 1)[-1]}: {'; '.join(reqs)}")
EOF
done
ls -l "$DEST" "$DEST/alt"
du -sh "$DEST"

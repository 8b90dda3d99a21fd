#!/usr/bin/env bash
# `make gpu-wheels`: the Python packages Ridgeline imports that a bare GPU machine lacks, as wheels
# in bench/gpu/wheels (git-ignored), for `make test-gpu` there (docs/gpu.md).
#
# Run it here, where pip reaches PyPI. The GPU machine (CPython 3.12, x86-64, PyTorch with CUDA,
# transformers, peft, pyarrow, numpy, safetensors, tokenizers, PyYAML, packaging, sympy, pytest
# preinstalled) has no package registry and receives at most 64 MiB of files per call, so the
# wheels travel with the working tree and install with `pip install --no-index --no-deps`. Hence
# one pinned version of each, downloaded with --no-deps, and every dependency the image lacks
# named below; the check at the end refuses a wheel whose requirement is neither here nor in the
# image. Versions are those the CPU suite runs with.
#
# Not carried, on purpose: gguf (transformers imports it only to read a .gguf file; the GPU tests
# build random:// models) and datasets (only `ridgeline prepare gsm8k` from the hub needs it, and
# the GPU machine has no hub). Ray, vLLM and SGLang are large CUDA builds, not pure wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."

DEST=bench/gpu/wheels
LIMIT_MIB=60
PYTHON=${PYTHON:-python3}

WHEELS=(
    omegaconf==2.3.1               # ridgeline.config; needs antlr4 4.9.*, PyYAML (image)
    hydra-core==1.3.8              # load_config composes with Hydra; needs omegaconf, antlr4, packaging (image)
    math-verify==0.9.0             # symbolic answers of the math envs (ridgeline.envs.rewards); needs latex2sympy2_extended
    latex2sympy2_extended==1.11.0  # needs sympy (image), antlr4 >= 4.9.3
)
# antlr4's 4.9 line (the one omegaconf and hydra accept) is published as a source archive only:
# built into a wheel here (pure Python, no compiler involved).
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3)
# What the wheels require that the GPU image already has (checked below).
IMAGE_HAS="pyyaml packaging sympy"

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "${WHEELS[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w "$DEST" "${SOURCE_ONLY[@]}"

# Every requirement (for CPython 3.12 on Linux, extras left out) must be a wheel here or in the image.
"$PYTHON" - "$DEST" "$IMAGE_HAS" <<'PY'
import sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

folder, image = Path(sys.argv[1]), {canonicalize_name(n) for n in sys.argv[2].split()}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
wheels = {}
for whl in sorted(folder.glob("*.whl")):
    name = canonicalize_name(whl.name.split("-")[0])
    if name in wheels:
        sys.exit(f"two versions of {name} in {folder}: {wheels[name].name}, {whl.name}")
    wheels[name] = whl
missing = []
for name, whl in wheels.items():
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                dep = canonicalize_name(req.name)
                if dep not in wheels and dep not in image:
                    missing.append(f"{whl.name} requires {req}")
if missing:
    sys.exit("not carried and not in the GPU image:\n  " + "\n  ".join(missing))
PY

ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "bench/gpu/wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(awk -v b="$total" 'BEGIN {printf "%.2f", b / 1048576}') MiB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "error: over ${LIMIT_MIB} MiB; a device call carries at most 64 MiB with the working tree" >&2
    exit 1
fi

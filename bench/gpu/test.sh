#!/usr/bin/env bash
# `make test-gpu`: tests/gpu on a GPU machine (docs/gpu.md). Uses the machine's own python3, which
# holds PyTorch with CUDA, plus the wheels `make gpu-wheels` put in bench/gpu/wheels (carried with
# the working tree), installed into a folder of their own. Creates no virtual environment and
# reaches no registry. Arguments go to pytest (e.g. -k sleep).
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS=bench/gpu/wheels
SITE=${RIDGELINE_GPU_SITE:-/tmp/ridgeline-gpu-site}
PYTHON=${PYTHON:-python3}

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "error: no wheels in $WHEELS. Run 'make gpu-wheels' on a machine with pip access and carry" \
         "bench/gpu/wheels to this one (docs/gpu.md)." >&2
    exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"

# the repository first (its ridgeline, not an installed one), then the carried packages
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
              + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))'
exec "$PYTHON" -m pytest -q -m gpu tests/gpu -s "$@"

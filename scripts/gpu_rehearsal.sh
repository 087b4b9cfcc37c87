#!/usr/bin/env bash
# The GPU check rehearsed on a CPU, as CI runs it (make test): proof that the rare GPU call
# will import the compiler and run every part of scripts/gpu_check.sh.
#
#   scripts/gpu_rehearsal.sh [VENV_DIR]      (default: a temporary directory)
#
# 1. a venv made like the GPU machine's image: torch, pytest, hypothesis, networkx,
#    tiktoken and numpy, and no lark, no graphviz (and a `dot` that fails first on PATH:
#    the GPU machine has none);
# 2. .whl/ filled by scripts/gpu_wheels.sh, the way a GPU run starts;
# 3. scripts/gpu_check.sh --rehearse with that venv's Python: the wheels installed from .whl/
#    with `pip install --no-index --no-deps --target`, every part run with the same
#    environment handling, the CUDA tests as CPU twins, bench/gpu.py --smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
VENV=${1:-$TMP/gpu-image}
start=$(date +%s)

# no byte-compiling: the venv takes about 35 s instead of 70 (torch is 1 GB)
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-compile \
  "torch==2.13.0" pytest hypothesis networkx tiktoken numpy
if "$VENV/bin/python" -c "import lark" 2>/dev/null ||
  "$VENV/bin/python" -c "import graphviz" 2>/dev/null; then
  echo "gpu_rehearsal: lark or graphviz is importable in $VENV; this rehearses nothing" >&2
  exit 1
fi
mkdir -p "$TMP/bin"
printf '#!/bin/sh\necho "dot: not on the GPU machine (rehearsal)" >&2\nexit 127\n' >"$TMP/bin/dot"
chmod +x "$TMP/bin/dot"
echo "gpu_rehearsal: venv like the GPU image in $(($(date +%s) - start)) s"

PYTHON="$PY" bash scripts/gpu_wheels.sh
env -u OUT PATH="$TMP/bin:$PATH" PYTHON="$VENV/bin/python" SCHEDC_SITE="$TMP/site" \
  OUT="$TMP/results" bash scripts/gpu_check.sh --rehearse
echo "gpu_rehearsal: green in $(($(date +%s) - start)) s (results in $TMP/results)"

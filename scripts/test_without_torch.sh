#!/usr/bin/env bash
# The torch-free tier (README, "Testing"): in a fresh venv that has everything schedc needs
# except torch, the compiler, the pictures and the CLI import and pass their tests.
#
#   scripts/test_without_torch.sh [VENV_DIR]     (default: a temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-$(mktemp -d)/schedc-notorch}
"$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
# schedc's dependencies without torch (pyproject.toml), then schedc itself without its deps
pip "lark>=1.1.9" "networkx>=3.0" "graphviz>=0.20" "tiktoken>=0.7" "numpy>=1.24" \
    "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100" "import-linter>=2.0"
pip --no-deps -e .
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "test_without_torch: torch is importable in $VENV; this tier proves nothing" >&2
  exit 1
fi
"$VENV/bin/python" -c "import schedc.passes.check, schedc.compiler, schedc.viz.timeline, \
schedc.cli.main; print('schedc imports without torch')"
# two workers: beside the GPU rehearsal and mypy (make test -j3), one process left a core idle
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not torch" -n "${WORKERS:-2}"

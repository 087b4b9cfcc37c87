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
# schedc's dependencies without torch and the test runner's, as pyproject.toml pins them
# (read from there: one list), then schedc itself without its deps
mapfile -t REQS < <("$PY" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
runner = ("pytest", "pytest-xdist", "hypothesis", "import-linter")
name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group()
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    if name(req) != "torch" and (req in project["dependencies"] or name(req) in runner):
        print(req)
PY
)
pip "${REQS[@]}"
pip --no-deps -e .
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "test_without_torch: torch is importable in $VENV; this tier proves nothing" >&2
  exit 1
fi
"$VENV/bin/python" -c "import schedc.passes.check, schedc.compiler, schedc.viz.timeline, \
schedc.cli.main; print('schedc imports without torch')"
# two workers: beside the GPU rehearsal and mypy (make test -j3), one process left a core idle
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not torch" -n "${WORKERS:-2}"

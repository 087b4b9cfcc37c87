#!/usr/bin/env bash
# Install schedc and what it needs into the current Python environment.
#
#   scripts/install.sh         the package (and torch)
#   scripts/install.sh test    also pytest, hypothesis and Graphviz's `dot`
#
# torch: a machine without a GPU gets the CPU build of torch 2.13.0 (on the machines this
# project is developed on, pip finds that wheel on local disk; set SCHEDC_TORCH_INDEX to
# https://download.pytorch.org/whl/cpu elsewhere). A machine with a GPU gets PyPI's CUDA
# build. Either way it happens before installing schedc, whose `torch>=2.4` is then met.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# Done already? `make demo` ran this on every call (about 25 s of pip). The stamp names what
# was installed: this interpreter and this pyproject.toml, then the mode (a `test` install
# serves a plain one too); and schedc must still import from this checkout, with torch.
# Anything else installs again.
STAMP=.installed
MODE=${1:-run}
want="$("$PY" -c 'import sys; print(sys.executable)') $(sha256sum pyproject.toml | cut -c1-16)"
have=$(cat "$STAMP" 2>/dev/null || true)
if { [ "$have" = "$want test" ] || [ "$have" = "$want $MODE" ]; } &&
   "$PY" -c "import schedc, torch, os, sys; sys.exit(os.path.dirname(os.path.dirname(os.path.abspath(schedc.__file__))) != os.getcwd())" 2>/dev/null &&
   { [ "$MODE" != "test" ] || command -v dot >/dev/null 2>&1; }; then
  echo "schedc: installed already ($STAMP: remove it to install again)"
  exit 0
fi
rm -f "$STAMP"

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "schedc: GPU found: installing torch (CUDA build) from PyPI"
    pip_install "torch>=2.4"
  else
    echo "schedc: no GPU: installing the CPU build of torch 2.13.0"
    pip_install "torch==2.13.0" ${SCHEDC_TORCH_INDEX:+--index-url "$SCHEDC_TORCH_INDEX"}
  fi
fi

if [ "${1:-}" = "test" ]; then
  pip_install -e ".[test]"
  if ! command -v dot >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "schedc: installing Graphviz (dot) with apt-get"
      DEBIAN_FRONTEND=noninteractive apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null
    else
      echo "schedc: Graphviz's dot is missing; install it (apt-get install graphviz," \
           "brew install graphviz) to render images. DOT text output works without it."
    fi
  fi
else
  pip_install -e .
fi
echo "$want $MODE" > "$STAMP"

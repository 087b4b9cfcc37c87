#!/usr/bin/env bash
# Fill .whl/ with the wheels the GPU machine lacks, so that scripts/gpu_check.sh can import
# the compiler there: lark and graphviz (the GPU image has torch, pytest, hypothesis,
# networkx, tiktoken and numpy, and no network). Run it here, before the GPU call:
#
#   bash scripts/gpu_wheels.sh          # then `.whl` travels (the device tool's `carry`)
#
# Both are pure Python (py3-none-any), so the wheels pip picks for the GPU machine's Python
# 3.12 are the ones any Python 3 installs; the versions are the ones the suite runs with
# here. .whl/ is kept out of git through .git/info/exclude, never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(lark==1.3.1 graphviz==0.21)
DEST=.whl

if [ -d .git ] && ! grep -qxF "/$DEST/" .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info
  echo "/$DEST/" >>.git/info/exclude
fi
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}"
n=0
for w in "$DEST"/*.whl; do
  case "$w" in
    *-py3-none-any.whl) n=$((n + 1)) ;;
    *) echo "gpu_wheels: $w is not pure Python; it may not install on the GPU machine" >&2; exit 1 ;;
  esac
done
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: expected ${#WHEELS[@]} wheels in $DEST, found $n" >&2
  exit 1
fi
echo "gpu_wheels: $(cd "$DEST" && ls -1 | tr '\n' ' ')in $DEST/ ($(du -sh "$DEST" | cut -f1))"

#!/usr/bin/env bash
# The GPU check: everything one rare GPU call must answer, in one command of about 5 minutes.
#
#   bash scripts/gpu_wheels.sh           # here, first: lark and graphviz into .whl/
#   bash scripts/gpu_check.sh            # on the GPU machine, .whl/ carried: results in $OUT
#   bash scripts/gpu_check.sh --rehearse # on a CPU, the same steps (scripts/gpu_rehearsal.sh)
#
# The GPU machine (one H200, Python 3.12, torch + CUDA, pytest, hypothesis, networkx,
# tiktoken, numpy; no lark, no graphviz, no `dot`, no network) is lent for 15 minutes in all,
# start-up included, and 10 minutes a command: this check must end well inside one command
# and leave time to run it again. Its parts, each with its own timeout (the script's status
# is the first failure's, and a part that hangs cannot eat the others' time):
#
# 1. imports (<= 60 s): lark and graphviz from .whl/ into a site folder put on PYTHONPATH,
#    which every process started below inherits; then the compiler imports and compiles
#    every bundled schedule. Without them nothing else can run, so a failure ends the check.
# 2. bench/gpu.py (budget 170 s, builds included, killed at 200 s): build-nanogpt's loop against schedc at
#    world 1, the cases that decide the bars first (nanogpt, schedc single and FSDP
#    bf16+compile: about 40 s of compile each on the H200, measured 2026-11-30). Its table,
#    JSON and three profiler traces land in the results.
# 3. tests/exec/test_cuda.py (<= 90 s): every numerics case at world 1 against the CPU
#    reference, the second step under torch.cuda.set_sync_debug_mode("error").
# 4. tests/exec/test_cuda_world.py (<= 150 s): ranks sharing the GPU at worlds 2 and 4, the
#    CUDA sanitizer over every bundled schedule, stream sleeps, resume, reserved memory.
#
# Worst case 60 + 200 + 90 + 150 s = 8 min 20 s; about 5 minutes when nothing hangs, so a
# second run fits in the 15 minutes.
#
# --rehearse runs the same parts on a CPU (CI does, in a venv made like the GPU machine's
# image: scripts/gpu_rehearsal.sh): the wheels installed the same way, the CUDA tests as
# their CPU twins (SCHEDC_GPU_REHEARSAL=1: same code paths and tolerance logic, skipping what
# needs a device), bench/gpu.py --smoke on the CPU with its real budget logic; each part's
# timeout is four times the GPU machine's (rank twins on two cores; world 4 only on a GPU).
#
# Results (at most 8 files come back from the GPU machine): gpu_check.log (everything printed),
# bench_gpu.json, benchmarks.md (docs/benchmarks.md with its GPU section rewritten) and
# trace_*.json.gz, in $OUT, or ./gpu-results without it.
set -u
cd "$(dirname "$0")/.."
REHEARSE=0
BENCH_ARGS=()
for arg in "$@"; do
  case "$arg" in
    --rehearse) REHEARSE=1 ;;
    *) BENCH_ARGS+=("$arg") ;;
  esac
done
RES="${OUT:-$PWD/gpu-results}"
mkdir -p "$RES"
exec > >(tee "$RES/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SITE="${SCHEDC_SITE:-/tmp/site}"
start=$(date +%s)
status=0
elapsed() { echo $(($(date +%s) - start)); }
part() {  # part NAME TIMEOUT_S COMMAND...: run it, note its exit status
  local name=$1 limit=$(($2 * SCALE))
  shift 2
  echo "== $name ($(elapsed) s so far)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  [ "$rc" -eq 124 ] && echo "gpu_check: $name timed out after $limit s"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "gpu_check: $name exit $rc"
  fi
  return "$rc"
}

SCALE=1  # the parts' timeouts are the GPU machine's; a 2-core CPU runs the twins slower
if [ "$REHEARSE" = 1 ]; then
  export SCHEDC_GPU_REHEARSAL=1
  SCALE=4
  BENCH=(--smoke --device cpu --compile-backend aot_eager --budget-s 120)
  echo "gpu_check: rehearsal on $(uname -m), the CUDA tests as CPU twins"
else
  BENCH=(--budget-s 170)
fi

# 1. imports
if ! "$PY" -c "import lark, graphviz" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: lark/graphviz are missing and no .whl/ was carried: run" \
      "'bash scripts/gpu_wheels.sh' on a machine with a network, and carry .whl"
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$SITE" .whl/*.whl ||
    { echo "gpu_check: installing .whl/ into $SITE failed"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
part imports 60 "$PY" - <<'PY' || exit 1
import sys, time
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
import graphviz, lark
print("lark", lark.__version__, "from", lark.__file__)
print("graphviz", graphviz.__version__, "from", graphviz.__file__)
from schedc.compiler import compile_file
from schedc.lang.resources import bundled_schedules
t0 = time.perf_counter()
paths = bundled_schedules()
for p in paths:
    compile_file(p)
print(f"compiled {len(paths)} bundled schedules in {time.perf_counter() - t0:.1f} s")
PY

# 2. the benchmark: the bars first
cp docs/benchmarks.md "$RES/benchmarks.md" 2>/dev/null
part bench/gpu.py 200 "$PY" bench/gpu.py "${BENCH[@]}" --out "$RES" \
  --write-docs "$RES/benchmarks.md" "${BENCH_ARGS[@]}"

# 3. and 4. the CUDA tests (their CPU twins when rehearsed)
part tests/exec/test_cuda.py 90 "$PY" -m pytest -q -rs -p no:cacheprovider --durations=5 \
  tests/exec/test_cuda.py
part tests/exec/test_cuda_world.py 150 "$PY" -m pytest -q -s -rs -p no:cacheprovider \
  --durations=0 tests/exec/test_cuda_world.py

echo "gpu_check: done in $(elapsed) s, status $status; results in $RES"
exit $status

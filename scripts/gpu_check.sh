#!/usr/bin/env bash
# The GPU check of issue 13, from a bare GPU machine that has torch (CUDA) but maybe not
# lark or graphviz, in about 7 minutes at most:
#
#   bash scripts/gpu_check.sh            # results in $OUT, or ./gpu-results without it
#
# 1. wheels carried in .whl/ (see /work/notes/gpu_wheels.md for how they are fetched) are
#    installed into /tmp/site, when schedc's imports need them;
# 2. tests/exec/test_cuda.py: the executor on CUDA/NCCL against the CPU reference (<= 90 s);
# 3. tests/exec/test_cuda_world.py (issue 20, <= 180 s): ranks sharing the GPU over gloo at
#    worlds 2 and 4, TORCH_CUDA_SANITIZER=1 over every bundled schedule (and a removed wait
#    it must report), injected stream sleeps, FSDP resume on CUDA, reserved memory;
# 4. bench/gpu.py: build-nanogpt's loop, the plain fp32 loop and schedc at world 1 under
#    each policy, interleaved (its own budget 110 s for rounds, killed at 150 s).
# Worst case 90 + 180 + 150 s plus start-up: about 7 minutes.
# Each part has its own timeout, so one that hangs cannot eat the others' time; the
# script's status is the first failure's.
set -u
cd "$(dirname "$0")/.."
RES="${OUT:-$PWD/gpu-results}"
mkdir -p "$RES"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
start=$(date +%s)
status=0

if ! "$PY" -c "import lark, graphviz" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "gpu_check: wheel install failed"; exit 1; }
        export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_check: lark/graphviz missing and no .whl/ carried (see gpu_wheels.md)"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY' 2>&1 | tee "$RES/env.txt"
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY

echo "== tests/exec/test_cuda.py"
timeout 90 "$PY" -m pytest -q -x tests/exec/test_cuda.py -p no:cacheprovider \
    2>&1 | tee "$RES/test_cuda.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && status=$rc && echo "gpu_check: test_cuda.py exit $rc"

echo "== tests/exec/test_cuda_world.py ($(( $(date +%s) - start )) s so far)"
timeout 180 "$PY" -m pytest -q -s -rs tests/exec/test_cuda_world.py -p no:cacheprovider --durations=0 \
    2>&1 | tee "$RES/test_cuda_world.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc && echo "gpu_check: test_cuda_world.py exit $rc"

echo "== bench/gpu.py ($(( $(date +%s) - start )) s so far)"
cp docs/benchmarks.md "$RES/benchmarks.md" 2>/dev/null
timeout 150 "$PY" bench/gpu.py --budget-s 110 --write-docs "$RES/benchmarks.md" "$@" \
    2>&1 | tee "$RES/bench_gpu.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc && echo "gpu_check: bench/gpu.py exit $rc"
echo "gpu_check: done in $(( $(date +%s) - start )) s, status $status; results in $RES"
exit $status

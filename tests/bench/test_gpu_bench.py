"""bench/gpu.py, the GPU check's benchmark, is no measurement when it times nothing: its exit
status says so, so the rehearsal (scripts/gpu_rehearsal.sh, in `make test`) fails rather than
saying green over a benchmark that built 2 of 12 cases and timed 0 steps."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest

from tests.goldens import REPO
from tests.ranks import python

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

SMOKE = ["bench/gpu.py", "--smoke", "--device", "cpu", "--compile-backend", "aot_eager"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_benchmark_that_timed_no_step_fails(tmp_path):
    # a budget that fits the first case's build and nothing after it: no round runs
    r = python(*SMOKE, "--budget-s", "1", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "bench/gpu.py: FAILED: no step was timed (1 of 12 cases built)" in r.stdout


def test_what_makes_a_run_no_measurement():
    gpu = _bench()
    run = gpu.Run.__new__(gpu.Run)  # the verdict reads only what the cases did
    timed, untimed = SimpleNamespace(times=[0.1]), SimpleNamespace(times=[])
    run.names, run.failed = ["a", "b", "c"], {}
    run.recs, run.not_built = {"a": timed, "b": timed}, {"c": "its build does not fit"}
    assert run.short(smoke=False) == ""  # a GPU run may leave a case out, and says why
    assert "1 of 3 cases not built (c)" in run.short(smoke=True)  # a rehearsal may not
    run.recs["c"], run.not_built = untimed, {}
    assert run.short(smoke=False) == "built but never timed: c"
    run.recs = {"a": untimed}
    assert run.short(smoke=False).startswith("no step was timed")
    run.failed = {"a": "RuntimeError in a timed step"}  # said as a failure already
    assert run.short(smoke=False).startswith("no step was timed")

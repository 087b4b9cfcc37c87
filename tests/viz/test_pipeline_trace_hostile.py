"""`schedc render PIPE.sched --trace X --compare` refuses a hostile trace in one line (#42).

The pipeline trace is read by the trace file's one reader (analysis/trace/stream.py), as
the data-parallel trace is: a regular file of bounded size, its JSON's depth and numbers
bounded. Each file here once ended in a traceback (exit 2), a hang or unbounded memory; each
is now exit 1 with one line naming the file. The FIFO and /dev/zero run in a process of
their own with a timeout (reading either never ends where it is not refused first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from schedc.analysis.pipeline_trace import trace_file
from schedc.cli.main import main
from tests.goldens import REPO
from tests.viz.test_pipeline_trace import INTERLEAVED, simulated_spans


@pytest.fixture(scope="module")
def good() -> dict:
    c, spans, _ = simulated_spans(INTERLEAVED)
    return json.loads(json.dumps(trace_file(spans, "x", c.pipeline.programs, 1)))


def _spans_at(good: dict, ts: float, dur: float | None = None) -> dict:
    data = json.loads(json.dumps(good))
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            e["ts"], e["dur"] = ts, e["dur"] if dur is None else dur
    return data


def _one_ts(good: dict, ts) -> dict:
    data = json.loads(json.dumps(good))
    next(e for e in data["traceEvents"] if e["ph"] == "X")["ts"] = ts
    return data


HOSTILE = {
    "traceEvents-a-number": (lambda g: json.dumps({**g, "traceEvents": 5}), "got 5"),
    "ts-10**400": (lambda g: json.dumps(_one_ts(g, 10**400)), "(401 digits)"),
    "nested-100k": (lambda g: "[" * 100_000, "nested too deeply"),
    "spans-at-1e300": (lambda g: json.dumps(_spans_at(g, 1e300, 1e300)), "at most 1e+18"),
    "ts-NaN": (lambda g: json.dumps(_one_ts(g, float("nan"))), "got NaN"),
    "event-a-list": (lambda g: json.dumps({**g, "traceEvents": [[1]]}), "expected an object"),
    "item-a-string": (
        lambda g: json.dumps(g).replace('"item": 0', '"item": "0"', 1),
        'args.item: expected an integer >= 0, got "0"',
    ),
    "pid-huge": (
        lambda g: json.dumps(g).replace('"pid": 0, "tid"', '"pid": 1e400, "tid"', 1),
        "expected a rank",
    ),
}


def _render(trace, tmp_path) -> list[str]:
    return ["render", str(INTERLEAVED), "--trace", str(trace), "--compare",
            "-o", str(tmp_path / "m.dot")]  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_trace_is_refused_in_one_line(name, good, tmp_path, capsys):
    make, said = HOSTILE[name]
    trace = tmp_path / "t.json"
    trace.write_text(make(good))
    assert main(_render(trace, tmp_path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"schedc: error: {trace}: "), err
    assert said in err[0]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_trace_that_is_no_file_is_refused_without_reading_it(kind, tmp_path):
    """A FIFO once waited for a writer forever; a symlink to /dev/zero grew to 10 GB."""
    trace = tmp_path / "t.json"
    if kind == "fifo":
        os.mkfifo(trace)
    else:
        trace.symlink_to("/dev/zero")
    r = subprocess.run(
        [sys.executable, "-m", "schedc", *_render(trace, tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip() == f"schedc: error: cannot read trace {trace}: not a regular file"


def test_a_step_of_minutes_is_drawn(good, tmp_path, capsys):
    """A measured step longer than 24 s: the grid's time axis once ran out of tick sizes."""
    data = json.loads(json.dumps(good))
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            e["ts"], e["dur"] = e["ts"] * 1e4, e["dur"] * 1e4
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(data))
    assert main(_render(trace, tmp_path)) == 0
    assert "step 2.7e+05 ms" in capsys.readouterr().out

"""The streaming trace reader (`analysis/trace/stream.py` `_Stream`) reads exactly what `validate` reads
from the parsed JSON: the same Trace for every file it takes, and for every file it cannot
take in its stride it gives way (`_Unstreamable`), so `load` judges it whole and says what
`validate` says. Checked on simulated traces and 600 mutations of them, read in chunks of a
few bytes (every value cut somewhere) and of the default size."""

from __future__ import annotations

import io
import json
import random

import pytest

import schedc.analysis.trace.stream as trace_mod
from schedc.analysis.cost import CostModel
from schedc.analysis.simulate import simulate
from schedc.analysis.trace.read import validate
from schedc.analysis.trace.schema import Trace, TraceError
from schedc.analysis.trace.stream import _Stream, _Unstreamable, load
from schedc.analysis.trace.write import chrome_trace
from schedc.compiler import compile_file
from tests.goldens import REPO
from tests.viz.test_trace_fuzz import mutate


def simulated(name: str = "tiny_fsdp_prefetch") -> dict:
    """A trace as `schedc run --trace` writes it, two steps, with a probe event and a span
    whose stream only its thread names."""
    path = REPO / "schedules" / f"{name}.sched"
    c = compile_file(path)
    data = chrome_trace(simulate(c, CostModel()), step=1, path=str(path))
    second = chrome_trace(simulate(c, CostModel()), step=2)["traceEvents"]
    data["traceEvents"] += [e for e in second if e["ph"] == "X"]
    data["traceEvents"].append(
        {"name": "probe allreduce 64", "ph": "X", "pid": 0, "tid": 9, "ts": 1, "dur": 2,
         "cat": "probe", "args": {"kind": "allreduce", "bytes": 64, "ranks": 2, "rep": 0}}
    )  # fmt: skip
    span = next(e for e in data["traceEvents"] if e["ph"] == "X" and "@" in e["name"])
    data["traceEvents"].append(dict(span, args={"step": 3}))
    return data


def streamed(text: str, chunk: int) -> Trace:
    reader = _Stream(io.BytesIO(text.encode("utf-8", "surrogatepass")), "t.json")
    reader.want = chunk
    return reader.trace()


def whole(text: str) -> Trace:
    return validate(json.loads(text), "t.json")


@pytest.mark.parametrize("chunk", [1, 7, 4 << 20])
def test_a_trace_streams_to_what_validate_reads(chunk):
    data = simulated()
    for text in (json.dumps(data), json.dumps(data, indent=2), json.dumps(data["traceEvents"])):
        got, want = streamed(text, chunk), whole(text)
        assert got == want
        assert len(got.spans) > 50 and len(got.probes) == 1
    assert want.schedule is None  # the array form has no otherData
    assert streamed(json.dumps(data), chunk).schedule.endswith("tiny_fsdp_prefetch.sched")
    assert {s.stream for s in got.spans} == {"compute", "comm"}  # thread names resolved


def test_mutated_traces_stream_the_same_or_give_way():
    rng = random.Random(1234)
    base = json.dumps(simulated("tiny_ddp_overlap"))
    took = gave_way = 0
    for _ in range(600):
        text = mutate(rng, json.loads(base))
        try:
            want: Trace | str = whole(text)
        except (ValueError, RecursionError, TraceError) as e:  # json.loads's, or validate's
            want = type(e).__name__
        for chunk in (5, 4 << 20):
            try:
                got = streamed(text, chunk)
            except _Unstreamable:
                gave_way += 1
                continue
            took += 1
            assert got == want, text[:200]
    assert took > 300 and gave_way > 50, (took, gave_way)


def test_load_judges_a_broken_file_whole(tmp_path):
    t = tmp_path / "t.json"
    data = simulated()
    data["traceEvents"][3]["pid"] = -1
    t.write_text(json.dumps(data)[:-3] + "]  }")  # a bad event, and a syntax error after it
    with pytest.raises(TraceError, match="not JSON"):  # what json.loads finds first
        load(t)
    t.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"traceEvents\[3\]\.pid: expected a rank"):
        load(t)


def test_a_file_over_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    t = tmp_path / "t.json"
    with open(t, "wb") as f:
        f.truncate(trace_mod.MAX_BYTES + 1)  # sparse: nothing to read, had it been read
    monkeypatch.setattr(trace_mod, "_Stream", None)  # reading it would fail differently
    with pytest.raises(TraceError, match="larger than 256 MiB"):
        load(t)

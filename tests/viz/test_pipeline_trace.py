"""A pipeline run's trace (analysis/pipeline_trace.py) and its measured grid (#31).

A trace built from the simulation itself (each item's simulated start and end, read as ms)
must measure back to the simulation: the same bubble, each kind's cost per stage, no latency;
drawn with --compare, the prediction at those costs and the "measured" grid coincide. Its
DOT is a golden (tests/golden/render/pipeline_trace_*.dot, SCHEDC_REGEN=1 rewrites it). The
real run is tests/exec/test_pipeline_run.py's `--trace` test.
"""

from __future__ import annotations

import json

import pytest

from schedc.analysis.pipeline_trace import (
    ItemSpan,
    PipeTraceError,
    load,
    measure,
    trace_file,
    validate,
)
from schedc.cli.main import main
from schedc.compiler import compile_file
from schedc.ir.op import Kind
from schedc.passes.pipeline_check import prove
from schedc.passes.pipeline_sim import Costs, simulate
from tests.goldens import GOLDEN, REPO, assert_golden

INTERLEAVED = REPO / "schedules" / "pipeline" / "tiny_pp2_interleaved.sched"
DP2 = REPO / "schedules" / "pipeline" / "tiny_pp2_dp2.sched"


def simulated_spans(path, costs: Costs | None = None, steps: int = 2) -> tuple:
    """Every global rank's spans of `steps` steps, as the simulation times them (in ms,
    steps 1 s apart); and the compiled schedule."""
    c = compile_file(str(path))
    plan = c.pipeline
    assert plan is not None
    t = simulate(prove(plan.pipeline, plan.programs).graph, costs or plan.costs)
    spans = [
        ItemSpan(r * c.spec.dp + d, step, i, step + a / 1e3, step + t.ends[(r, i)] / 1e3)
        for step in range(steps)
        for d in range(c.spec.dp)
        for (r, i), a in sorted(t.starts.items())
    ]
    return c, spans, t


COMPUTE = {(Kind.F, s): 1.0 + s / 4 for s in range(4)} | {
    (Kind.B, s): 2.0 + s / 2 for s in range(4)
}
FREE = Costs.measured(COMPUTE)
# transfers that take time, ranks that post at their own pace, the executor's gap
TIMED = Costs.measured(COMPUTE, latency=0.5, post=0.05, gap=0.001, post_at={1: 0.2})


@pytest.mark.parametrize("costs", [FREE, TIMED], ids=["free", "timed"])
@pytest.mark.parametrize("path", [INTERLEAVED, DP2], ids=["interleaved", "dp2"])
def test_a_simulated_trace_measures_back_to_its_simulation(path, costs):
    """Calibrated on a trace of the simulation, the simulation predicts that trace: the
    latency counts only readers that waited (interleaved's receives are posted early, and
    a reader that found its transfer arrived says nothing of it), from the later posting's
    start, and each rank keeps its own posting time."""
    c, spans, t = simulated_spans(path, costs)
    plan = c.pipeline
    data = json.loads(json.dumps(trace_file(spans, str(path), plan.programs, c.spec.dp)))
    trace = validate(data, "t.json", plan.programs, c.spec.dp)
    assert trace.steps == [0, 1] and (trace.pp, trace.dp) == (plan.pipeline.pp, c.spec.dp)
    m = measure(trace.spans, plan.programs, 1, c.spec.dp)
    assert m.step == pytest.approx(t.step)
    for r in plan.programs:
        assert m.bubble[r] == pytest.approx(t.bubble[r])
    for (kind, stage), ms in m.costs().items():
        assert ms == pytest.approx(costs.of(kind, stage))
    cal = m.calibrated()
    assert cal.latency == pytest.approx(costs.latency, abs=1e-6)
    assert cal.gap == pytest.approx(costs.gap, abs=1e-6)
    for r in plan.programs:
        assert cal.posting(r) == pytest.approx(costs.posting(r), abs=1e-6)
    if costs is TIMED:
        assert m.latencies() and all(x == pytest.approx(0.5) for x in m.latencies())
    again = simulate(prove(plan.pipeline, plan.programs).graph, cal)
    assert again.bubble == pytest.approx(m.bubble)


def test_a_trace_of_another_schedule_is_refused(tmp_path):
    c, spans, _ = simulated_spans(INTERLEAVED, steps=1)
    plan = c.pipeline
    data = trace_file(spans, "x", plan.programs, 1)
    other = compile_file(str(REPO / "schedules" / "pipeline" / "tiny_pp4_1f1b.sched"))
    with pytest.raises(PipeTraceError, match="4 pipeline ranks|2 pipeline ranks"):
        validate(data, "t.json", other.pipeline.programs, 1)
    data["traceEvents"][-1]["name"] = "F[s9]@mb0"
    with pytest.raises(PipeTraceError, match=r"traceEvents\[\d+\]\.name: 'F\[s9\]@mb0'"):
        validate(data, "t.json", plan.programs, 1)
    (tmp_path / "t.json").write_text('{"traceEvents": []}')
    with pytest.raises(PipeTraceError, match="not a pipeline trace"):
        load(str(tmp_path / "t.json"), plan.programs, 1)


def test_render_compare_golden(tmp_path, capsys):
    """The trace of the simulation at unit costs: measured and predicted grids coincide."""
    c, spans, _ = simulated_spans(INTERLEAVED)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(trace_file(spans, "x", c.pipeline.programs, 1)))
    out = tmp_path / "m.dot"
    argv = ["render", str(INTERLEAVED), "--trace", str(trace), "--compare", "-o", str(out)]
    assert main(argv) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[1:] == [
        "  tiny_pp2_interleaved.sched: step 27 ms, bubble rank 0 11.1%, rank 1 11.1%",
        "  tiny_pp2_interleaved.sched: step 27 ms, bubble rank 0 11.1%, rank 1 11.1%",
    ]
    dot = out.read_text()
    predicted, measured = dot.split("measured: step 1 of t.json")
    assert predicted.count('class="pp_F"') == measured.count('class="pp_F"') == 16
    assert_golden(GOLDEN / "render" / "pipeline_trace_interleaved.dot", dot)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--step", "1"], "--step draws a traced step; add --trace RUN.json"),
        (["--compare"], "--compare draws a traced step; add --trace RUN.json"),
        (["--trace", "{t}", "--step", "7"], "--step 7: {t} holds steps 0, 1"),
    ],
)
def test_render_trace_flags(flags, said, tmp_path, capsys):
    c, spans, _ = simulated_spans(INTERLEAVED)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(trace_file(spans, "x", c.pipeline.programs, 1)))
    flags = [f.format(t=trace) for f in flags]
    assert main(["render", str(INTERLEAVED), *flags, "-o", str(tmp_path / "x.dot")]) == 1
    assert said.format(t=trace) in capsys.readouterr().err

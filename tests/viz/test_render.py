"""schedc render and calibrate: golden DOT, images, labels, the cost flags, measured traces.

Golden files live in tests/golden/render/; regenerate them after an intended change with
    SCHEDC_REGEN=1 python -m pytest tests/viz/test_render.py
Image tests need Graphviz's `dot`/`neato` and are skipped without them.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from schedc.analysis.calibrate import calibrate
from schedc.analysis.cost import CostModel
from schedc.analysis.overlap import overlap
from schedc.analysis.simulate import simulate
from schedc.analysis.trace.compare import measured, only_step
from schedc.analysis.trace.read import validate
from schedc.analysis.trace.stream import load
from schedc.analysis.trace.write import chrome_trace
from schedc.analysis.units import parse_rate, parse_time
from schedc.cli.main import main
from schedc.compiler import compile_file
from schedc.ir.op import Kind, Op
from schedc.lang.resources import bundled_schedules
from schedc.viz.graph import graph_dot
from schedc.viz.timeline import timeline_dot
from schedc.viz.timeline.panels import Panel, panels_for
from tests.goldens import GOLDEN, REPO, assert_golden

SCHEDULES = bundled_schedules()
IDS = [p.stem for p in SCHEDULES]
HAVE_DOT = shutil.which("dot") is not None and shutil.which("neato") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz (dot, neato) is not installed")


def golden(name: str, text: str) -> None:
    assert_golden(GOLDEN / "render" / name, text)


def sched(name: str):
    return compile_file(REPO / "schedules" / f"{name}.sched")


# -- golden DOT for every bundled schedule, both views --------------------------------------------


@pytest.mark.parametrize("path", SCHEDULES, ids=IDS)
def test_graph_view_golden(path):
    c = compile_file(path)
    dot = graph_dot([c])
    assert dot == graph_dot([compile_file(path)])  # deterministic
    golden(f"{path.stem}.graph.dot", dot)


@pytest.mark.parametrize("path", SCHEDULES, ids=IDS)
def test_timeline_view_golden(path):
    c = compile_file(path)
    golden(f"{path.stem}.timeline.dot", timeline_dot([Panel.of(c, simulate(c))]))


@needs_dot
@pytest.mark.parametrize("view", ["graph", "timeline"])
@pytest.mark.parametrize("path", SCHEDULES, ids=IDS)
def test_every_schedule_renders_svg(path, view, tmp_path, capsys):
    out = tmp_path / f"{path.stem}.svg"
    assert main(["render", str(path), "--view", view, "-o", str(out)]) == 0
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    assert f"wrote {out}" in capsys.readouterr().out


# -- the graph view: streams, events, collectives, folding ----------------------------------------


def test_graph_view_draws_streams_events_and_collectives():
    dot = graph_dot([sched("ddp_overlap")])
    assert "cluster_s0_compute" in dot and "cluster_s0_comm" in dot
    assert dot.count("style=dashed") == 3  # the plan's 3 events, and only they are dashed
    assert dot.count("shape=hexagon") == 2  # allreduce[b1]@mb3, allreduce[b2]@mb3
    assert 'label="allreduce[b1]@mb3"' in dot and 'label="complete gradients"' in dot


_EDGE = re.compile(r"^\s*(s\d+n\d+) -> (s\d+n\d+) \[(.*)\];$")
_GRAPH_CASES = [[p] for p in SCHEDULES] + [
    [REPO / "schedules" / "gpt2_1gpu.sched", REPO / "schedules" / "gpt2_8gpu.sched"]
]
_GRAPH_IDS = [*IDS, "gpt2_1gpu+gpt2_8gpu"]


@pytest.mark.parametrize("paths", _GRAPH_CASES, ids=_GRAPH_IDS)
def test_graph_view_edges_can_all_point_down(paths):
    """Without Graphviz: the drawn edges (program order, `after` and events, across stream
    clusters) form a DAG, and the graph asks dot to rank it as one (`newrank`), so every edge
    can go from an earlier rank to a later one; without newrank dot ranks each stream's
    cluster on its own and events between them loop upward (fsdp_prefetch: 6 of them)."""
    dot = graph_dot([compile_file(p) for p in paths])
    assert re.search(r"^  graph \[newrank=true, ", dot, re.M)
    edges = [m.groups()[:2] for m in map(_EDGE.match, dot.splitlines()) if m]
    import networkx as nx

    assert edges and nx.is_directed_acyclic_graph(nx.DiGraph(edges))


@needs_dot
@pytest.mark.parametrize("paths", _GRAPH_CASES, ids=_GRAPH_IDS)
def test_graph_view_edges_point_down_as_dot_lays_them_out(paths):
    """dot's own layout (`-Tplain`, y growing upward): every edge's head is below its tail."""
    import subprocess

    dot = graph_dot([compile_file(p) for p in paths])
    plain = subprocess.run(
        ["dot", "-Tplain"], input=dot, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    y: dict[str, float] = {}
    up = []
    for f in (line.split() for line in plain.splitlines()):
        if f[0] == "node":
            y[f[1]] = float(f[3])
        elif f[0] == "edge" and not y[f[1]] > y[f[2]]:
            up.append((f[1], f[2]))
    assert y and not up


def test_gpt2_1gpu_folds_30_microsteps_and_unfolds():
    c = sched("gpt2_1gpu")
    ops = len(c.plan().ops)
    folded, unfolded = graph_dot([c]), graph_dot([c], unfold=True)
    nodes = folded.count(" [label=")
    assert ops == 32 * 28 + 1
    assert nodes == 2 * 28 + 1 + 1  # mb0, mb31, optimizer.step, one fold node
    assert "mb1 .. mb30" in folded and "(x30, same ops)" in folded
    assert unfolded.count(" [label=") == ops
    assert "fwd[h.5]@mb17" in unfolded and "fwd[h.5]@mb17" not in folded


def test_two_schedules_side_by_side():
    dot = graph_dot([sched("gpt2_1gpu"), sched("gpt2_8gpu")])
    assert "cluster_s0" in dot and "cluster_s1" in dot
    assert "(x30, same ops)" in dot and "(x2, same ops)" in dot


# -- the timeline view: part of the step -----------------------------------------------------------


def test_window_draws_part_of_the_step():
    c = sched("ddp_overlap")
    panel = [Panel.of(c, simulate(c))]
    whole, part = timeline_dot(panel, unfold=True), timeline_dot(panel, True, window="mb3:")
    assert "drawn:" in part and "drawn:" not in whole
    assert "bwd[h.3]@mb0" in whole and "bwd[h.3]@mb0" not in part
    assert 'label="allreduce[b2]@mb3"' in part


# -- every collective named: a label in its box, or a mark and a row of the table ----------------

_NODE = re.compile(r"^\s+n\d+ \[(.*)\]$")
_ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\]]+)')
_ABBR = {Kind.ALLREDUCE: "AR", Kind.ALLGATHER: "AG", Kind.REDUCESCATTER: "RS"}


def _nodes(dot: str) -> list[dict[str, str]]:
    """The timeline DOT's nodes as attribute dicts (quotes and trailing \\l, \\r removed)."""
    out = []
    for line in dot.splitlines():
        m = _NODE.match(line)
        if m:
            kv = {k: v.strip('"') for k, v in _ATTR.findall(m.group(1))}
            kv["label"] = re.sub(r"\\[lr]$", "", kv.get("label", ""))
            out.append(kv)
    return out


def _naming(dot: str) -> tuple[dict[str, set[str]], set[str], list[dict]]:
    """(labels drawn in each op's boxes, keyed by IR text from the box's tooltip; the ops
    the legend table lists; the mark ticks)."""
    labels: dict[str, set[str]] = {}
    listed: set[str] = set()
    nodes = _nodes(dot)
    for n in nodes:
        if "tooltip" in n and n.get("label"):
            labels.setdefault(n["tooltip"].split(": ")[0], set()).add(n["label"])
        if n.get("class") == "legend_row":
            m = re.match(r"^[A-Z]{2} \S+  (\S+): ", n["label"])
            assert m, n["label"]
            listed.add(m.group(1))
    ticks = [n for n in nodes if n.get("class") == "mark" and n.get("shape") != "plaintext"]
    return labels, listed, ticks


def _assert_every_collective_named(panel: Panel) -> None:
    dot = timeline_dot([panel])
    labels, listed, ticks = _naming(dot)
    drawn = [i for i in panel.timeline.intervals if i.op.is_collective]
    assert drawn
    marked = 0
    for iv in drawn:
        name, op = str(iv.op), iv.op
        tail = f":{op.phase.value}" if op.phase else ""
        names = {name, f"{_ABBR[op.kind]} {op.target}{tail}", f"{_ABBR[op.kind]} {op.target}"}
        if name in labels:
            assert len(labels[name]) == 1, (name, labels[name])  # one name on every rank
            assert labels[name] <= names, (name, labels[name])
            assert name not in listed
        else:
            assert name in listed, f"{name}: neither labelled nor in the table"
            marked += 1
    assert len(ticks) == marked  # each marked op, on each rank drawn, has its tick
    assert len(listed) == len({str(i.op) for i in drawn if str(i.op) not in labels})
    for iv in panel.timeline.intervals:  # frees are drawn: a tick or a box, never a hairline
        if iv.op.kind is Kind.FREE:
            box = next(n for n in _nodes(dot) if n.get("tooltip", "").startswith(f"{iv.op}: "))
            assert float(box["width"]) * 72 >= 1.5


@pytest.mark.parametrize("path", SCHEDULES, ids=IDS)
def test_every_collective_is_labelled_or_in_the_table(path):
    """Predicted, and measured from a trace (a synthetic one priced differently): every
    collective has a label in its box, or a mark under it and a row in the table."""
    c = compile_file(path)
    if not any(op.is_collective for op in c.plan().ops):
        pytest.skip("no collectives")
    _assert_every_collective_named(Panel.of(c, simulate(c)))
    slow_comm = CostModel(bandwidth=20e9, latency=40e-6)
    _assert_every_collective_named(
        Panel.of(c, measured(c, validate(chrome_trace(simulate(c, slow_comm), step=1), "t")))
    )


def test_seed000_lists_each_of_its_13_buckets():
    """The 8-GPU lane beside the 1-GPU one: 13 narrow all-reduces, each its own table row."""
    c1, c8 = sched("gpt2_1gpu"), sched("gpt2_8gpu")
    dot = timeline_dot([Panel.of(c1, simulate(c1)), Panel.of(c8, simulate(c8))])
    _, listed, ticks = _naming(dot)
    assert listed == {f"allreduce[b{k}]@mb3" for k in range(1, 14)} and len(ticks) == 13


def test_the_same_op_has_one_label_on_every_rank():
    """Rank 1's all-reduces take a third of rank 0's time: each is still named one way."""
    c = sched("ddp_overlap")
    trace = chrome_trace(simulate(c))
    for e in list(trace["traceEvents"]):
        if e.get("pid") == 0:
            e1 = json.loads(json.dumps(e)) | {"pid": 1}
            if e1.get("cat") == "collective":
                e1["dur"] /= 3
            trace["traceEvents"].append(e1)
    tl = measured(c, validate(trace, "t"))
    assert tl.ranks == (0, 1)
    labels, _, _ = _naming(timeline_dot([Panel.of(c, tl)]))
    for iv in tl.intervals:
        if iv.op.is_collective and str(iv.op) in labels:
            assert len(labels[str(iv.op)]) == 1, labels[str(iv.op)]


# -- calibrate's parameters, read by render; the cost flags ----------------------------------------


def test_calibrate_cli_writes_params_that_render_reads(tmp_path, capsys):
    c = sched("fsdp_prefetch")
    true = CostModel(flops=80e12, bandwidth=40e9, latency=20e-6)
    trace = chrome_trace(simulate(c, true), path=str(REPO / "schedules" / "fsdp_prefetch.sched"))
    (tmp_path / "t.json").write_text(json.dumps(trace))
    params = tmp_path / "p.json"
    assert main(["calibrate", str(tmp_path / "t.json"), "-o", str(params)]) == 0
    out = capsys.readouterr().out
    assert "80 TFLOP/s" in out and "40 GB/s" in out and "20 us" in out
    assert CostModel.load(params).flops_tf32 == pytest.approx(80e12)  # fsdp_prefetch: fp32
    # flags win over the file, the file over the defaults
    assert (
        main(
            [
                "render",
                str(REPO / "schedules" / "fsdp_prefetch.sched"),
                "--view",
                "timeline",
                "--cost",
                str(params),
                "--bandwidth",
                "10G",
                "-o",
                str(tmp_path / "x.dot"),
            ]
        )
        == 0
    )
    dot = (tmp_path / "x.dot").read_text()
    assert "80 TFLOP/s compute, 10 GB/s bus bandwidth, 20 us per collective" in dot


def test_rates_and_times_parse():
    assert parse_rate("300T") == 300e12 and parse_rate("100GB/s") == 100e9
    assert parse_rate("2.5e14") == 2.5e14 and parse_rate("1.5 TFLOP/s") == 1.5e12
    assert parse_time("10us") == pytest.approx(1e-5) and parse_time("0.5ms") == 5e-4
    assert parse_time("2e-6") == 2e-6
    with pytest.raises(ValueError):
        parse_rate("-3G")


# -- a measured timeline from a real run -----------------------------------------------------------


@pytest.mark.torch
def test_measured_timeline_from_a_real_trace(real_trace):
    c = compile_file(real_trace / "w1.sched")
    trace = load(real_trace / "t.json")
    tl = measured(c, trace)
    assert tl.ranks == (0,) and {i.op for i in tl.intervals} == set(c.plan().ops)
    ov = overlap(tl)[0]
    assert len(ov.items) == 2
    assert ov.hidden >= 0 and ov.exposed >= 0
    assert ov.hidden + ov.exposed == pytest.approx(ov.comm)
    assert ov.comm == pytest.approx(sum(i.length for i in tl.intervals if i.op.is_collective))
    assert measured(c, trace, step=0).note.endswith("step 0")


@pytest.mark.torch
def test_render_and_calibrate_cli_on_a_real_trace(real_trace, capsys):
    d = real_trace
    assert (
        main(
            [
                "render",
                str(d / "w1.sched"),
                "--trace",
                str(d / "t.json"),
                "--compare",
                "-o",
                str(d / "m.dot"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "measured: rank 0: step" in out and "predicted: rank 0" in out
    assert main(["calibrate", str(d / "t.json"), "--schedule", str(d / "w1.sched")]) == 0
    assert "world 1: collectives move no data" in capsys.readouterr().out
    if HAVE_DOT:
        assert (
            main(
                [
                    "render",
                    str(d / "w1.sched"),
                    "--trace",
                    str(d / "t.json"),
                    "-o",
                    str(d / "m.svg"),
                ]
            )
            == 0
        )


def _step_of(out: str, which: str) -> float:
    """The step time `render` prints for the `which` ("predicted"/"measured") panel."""
    m = re.search(rf"{which}: rank 0: step ([0-9.e+-]+) ?([mun]?s);", out)
    assert m, out
    return parse_time(m.group(1) + m.group(2))


@pytest.mark.torch
def test_compare_without_cost_fits_the_model_to_the_trace(real_trace, capsys):
    """Without --cost the prediction is priced by calibrate's fit to the trace itself, and
    render says so: the predicted step is then within a sane factor of the measured one
    (the defaults, a GPU's, predict a strip of tens of microseconds for a CPU step of ms)."""
    d = real_trace
    argv = ["render", str(d / "w1.sched"), "--trace", str(d / "t.json"), "--compare"]
    assert main([*argv, "-o", str(d / "fit.dot")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("schedc: no --cost"))
    fit = calibrate(compile_file(d / "w1.sched"), only_step(load(d / "t.json"), None)[0])
    assert f"of {d / 't.json'}, the step drawn" in line
    assert fit.cost.describe(compile_file(d / "w1.sched").spec.numerics) in line
    predicted, measured_ = _step_of(out, "predicted"), _step_of(out, "measured")
    assert measured_ / 3 < predicted < measured_ * 3, out
    assert "fitted to t.json" in (d / "fit.dot").read_text()
    # with --cost, the file's model and no fit: the defaults' prediction is far off
    params = d / "defaults.json"
    params.write_text(CostModel().to_json())
    assert main([*argv, "--cost", str(params), "-o", str(d / "nofit.dot")]) == 0
    out = capsys.readouterr().out
    assert "no --cost" not in out and _step_of(out, "predicted") < _step_of(out, "measured") / 10


@pytest.mark.torch
def test_every_collective_of_a_real_trace_is_named(real_trace):
    c = compile_file(real_trace / "w1.sched")
    for panel in panels_for(
        [c], CostModel(), trace=load(real_trace / "t.json"), step=None, compare=True
    ):
        _assert_every_collective_named(panel)


@pytest.mark.torch
def test_a_real_trace_has_step_slices_and_one_name_per_op(real_trace):
    """Perfetto shows each step as a slice `step N` on a "steps" track drawn first; every op
    span of step N lies inside it; each op is one span per step named by its IR text."""
    c = compile_file(real_trace / "w1.sched")
    events = json.loads((real_trace / "t.json").read_text())["traceEvents"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    order = {
        (e["pid"], e["tid"]): e["args"]["sort_index"]
        for e in events
        if e["name"] == "thread_sort_index"
    }
    ranks = sorted({e["pid"] for e in events if "pid" in e})
    assert ranks == list(range(c.spec.world))
    for r in ranks:
        (steps_tid,) = [t for (p, t), name in threads.items() if p == r and name == "steps"]
        assert order[(r, steps_tid)] < min(
            v for (p, t), v in order.items() if p == r and t != steps_tid
        )
        slices = sorted(
            (e for e in events if e["ph"] == "X" and e["pid"] == r and e["tid"] == steps_tid),
            key=lambda e: e["ts"],
        )
        assert [e["name"] for e in slices] == ["step 0", "step 1"]
        assert [e["args"]["step"] for e in slices] == [0, 1]
        assert slices[0]["ts"] + slices[0]["dur"] <= slices[1]["ts"]
        for sl in slices:
            n = sl["args"]["step"]
            mine = [
                e
                for e in events
                if e["ph"] == "X"
                and e["pid"] == r
                and e["tid"] != steps_tid
                and e["args"]["step"] == n
            ]
            assert sorted(e["name"] for e in mine) == sorted(str(op) for op in c.plan(r).ops)
            assert all(e["name"] == str(Op.parse(e["name"])) for e in mine)
            for e in mine:  # within the step; 1 us of slack for the microsecond rounding
                assert sl["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= sl["ts"] + sl["dur"] + 1


@pytest.mark.torch
def test_a_trace_of_another_schedule_is_refused(real_trace, capsys):
    code = main(
        [
            "render",
            str(REPO / "schedules" / "ddp_overlap.sched"),
            "--trace",
            str(real_trace / "t.json"),
            "-o",
            str(real_trace / "x.dot"),
        ]
    )
    assert code == 1
    assert "plan does not hold" in capsys.readouterr().err


# -- the command line ------------------------------------------------------------------------------


def test_without_graphviz_images_fail_cleanly_and_dot_text_works(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    ddp = str(REPO / "schedules" / "ddp_overlap.sched")
    assert main(["render", ddp, "-o", str(tmp_path / "g.svg")]) == 1
    err = capsys.readouterr().err
    assert "apt-get install graphviz" in err and "brew install graphviz" in err
    assert "Traceback" not in err and not (tmp_path / "g.svg").exists()
    assert main(["render", ddp, "--view", "timeline", "-o", str(tmp_path / "t.dot")]) == 0
    assert "\ndigraph timeline {" in (tmp_path / "t.dot").read_text()


def test_without_graphviz_the_message_names_the_command_that_draws_the_view(
    tmp_path, monkeypatch, capsys
):
    """A timeline's nodes are pinned: `dot` would lay them out again (a 13146x84 strip),
    so its message says `neato -n2`; a graph view's says `dot`."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    ddp = str(REPO / "schedules" / "ddp_overlap.sched")
    assert main(["render", ddp, "--view", "timeline", "-o", str(tmp_path / "t.svg")]) == 1
    err = capsys.readouterr().err
    assert "needs Graphviz's `neato` program" in err
    assert "render it elsewhere with `neato -n2 -Tsvg t.dot -o t.svg`" in err
    assert main(["render", ddp, "-o", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err
    assert "render it elsewhere with `dot -Tpng g.dot -o g.png`" in err and "neato" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-o", "x.jpg"], "use one of .svg, .png, .pdf, .dot"),
        (["-o", "x.dot", "--view", "graph", "--trace", "t.json"], "drop --view graph"),
        (["-o", "x.dot", "--compare"], "add --trace"),
        (["-o", "x.dot", "--step", "2"], "add --trace"),
        (["-o", "x.dot", "--window", "mb1:"], "add --view timeline"),
        (["-o", "x.dot", "--view", "timeline", "--window", "mb7:"], "no micro-step mb7"),
        (["-o", "x.dot", "--rank", "8"], "has ranks 0..7"),
        (
            ["-o", "x.dot", "--view", "timeline", "--flops", "fast"],
            "--flops fast: 'fast' is not a rate",
        ),
        (
            ["-o", "x.dot", "--view", "timeline", "--latency", "inf"],
            "latency must be between 0 and",
        ),
        (["-o", "x.dot", "--flops", "300T"], "--flops prices a predicted timeline"),
    ],
)
def test_usage_errors(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["render", str(REPO / "schedules" / "ddp_overlap.sched"), *argv]) == 1
    assert message in capsys.readouterr().err


def test_render_prints_hidden_and_exposed(tmp_path, capsys):
    assert (
        main(
            [
                "render",
                str(REPO / "schedules" / "ddp_overlap.sched"),
                "--view",
                "timeline",
                "-o",
                str(tmp_path / "t.dot"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "communication 4.76 ms: 1 ms hidden behind compute (21%), 3.76 ms exposed" in out

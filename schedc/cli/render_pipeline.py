"""`schedc render` of pipeline schedules: the pipeline grid (schedc/viz/pipeline.py).

    schedc render schedules/pipeline/tiny_pp4_1f1b.sched -o pp.svg          # the grid
    schedc render a.sched b.sched -o pair.svg       # several, stacked on one time scale
    schedc render pp.sched --trace t.json -o m.svg             # a step of `schedc run --trace`
    schedc render pp.sched --trace t.json --compare -o m.svg   # predicted above measured

Without a trace, the grid is predicted at the plan's unit costs. With `--trace` (one
schedule) it is the traced step (`--step`, default the last) of replica 0, in ms; with
`--compare` the prediction at that step's measured costs (each kind's mean per stage, the
measured transfer latency and posting time) is drawn above it on the same scale. The flags
of the data-parallel views (the graph, a window, the cost model in seconds) are each refused
in one line rather than ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from schedc.analysis.pipeline_trace import load, measure
from schedc.cli.common import given, overrides
from schedc.compiler import Compiled, compile_file
from schedc.errors import UserError
from schedc.lang.nodes import Pipeline
from schedc.lang.parse import parse
from schedc.lang.read import read_source
from schedc.lang.syntax import to_ast
from schedc.viz.dot import write
from schedc.viz.pipeline import Grid, grid_of, measured_grid, pipeline_dot, who

# flags a pipeline grid has no use for, and why (the first given is said)
REFUSED = (
    ("--window", "the grid draws the whole step"),
    ("--unfold", "the grid draws every compute action already"),
    ("--rank", "the grid draws every rank, one row each"),
    ("--cost", "the grid is timed at the plan's unit costs (F = 1 a stage), not in seconds"),
    ("--flops", "the grid is timed at the plan's unit costs (F = 1 a stage), not in seconds"),
    ("--bandwidth", "the grid is timed at the plan's unit costs (F = 1 a stage), not in seconds"),
    ("--inter-bandwidth", "the grid is timed at the plan's unit costs (F = 1 a stage)"),
    ("--node-size", "the grid is timed at the plan's unit costs (F = 1 a stage)"),
    ("--latency", "the grid is timed at the plan's unit costs (F = 1 a stage), transfers free"),
)


def is_pipeline(path: str) -> bool:
    """Whether the file parses to a schedule with a `pipeline { ... }` block (one that does
    not read or parse is left to the compiler to report, in its turn)."""
    try:
        source = read_source(path)
        return any(isinstance(s, Pipeline) for s in to_ast(parse(source), source).stmts)
    except (UserError, OSError):
        return False


def refuse(args: argparse.Namespace, file: str) -> None:
    """The first flag given that the pipeline grid does not draw with, in one line."""
    if args.view == "graph":
        raise UserError(
            f"--view graph: {file} is a pipeline schedule, drawn as its timeline (ranks as "
            "rows, time across); drop --view graph"
        )
    for flag, why in REFUSED:
        if given(args, flag):
            raise UserError(f"{flag}: {file} is a pipeline schedule and {why}; drop {flag}")


def render_pipeline(args: argparse.Namespace, out: Path) -> int:
    """Every file a pipeline schedule, each drawn as its grid, stacked on one time scale;
    or one, with a trace: its measured step (and with --compare the calibrated prediction)."""
    first = next(f for f in args.files if is_pipeline(f))
    refuse(args, first)
    if args.trace and len(args.files) != 1:
        raise UserError("--trace belongs to one schedule; give one FILE.sched")
    for flag in ("--step", "--compare"):
        if given(args, flag) and not args.trace:
            raise UserError(f"{flag} draws a traced step; add --trace RUN.json")
    compiled = [compile_file(f, overrides(args)) for f in args.files]
    for c in compiled:
        if c.pipeline is None:
            raise UserError(
                f"{c.source.path} is a data-parallel schedule and {first} a pipeline one: "
                "they share no picture; render them apart"
            )
    grids = _traced(compiled[0], args) if args.trace else [grid_of(c) for c in compiled]
    try:
        write(pipeline_dot(grids), out, "neato")
    except OSError as e:
        raise UserError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
    print(f"schedc: wrote {out} (pipeline timeline)")
    for g in grids:
        unit = "ms" if g.unit else "(F = 1 a stage)"
        print(f"  {g.name}: step {g.step:.4g} {unit}, bubble {_bubble(g.compiled, g.bubble)}")
    return 0


def _traced(c: Compiled, args: argparse.Namespace) -> list[Grid]:
    """The trace's step as a grid, and with --compare the prediction at its costs above."""
    plan = c.pipeline
    assert plan is not None
    trace = load(args.trace, plan.programs, c.spec.dp)
    step = trace.steps[-1] if args.step is None else args.step
    if step not in trace.steps:
        raise UserError(
            f"--step {step}: {args.trace} holds steps {', '.join(map(str, trace.steps))}"
        )
    m = measure(trace.spans, plan.programs, step, c.spec.dp)
    name = Path(args.trace).name
    bubble = _bubble(c, m.bubble)
    rep = " of replica 0" if c.spec.dp > 1 else ""
    grids = [
        measured_grid(
            c, m, f"measured: step {step}{rep} of {name}, {m.step:.1f} ms; bubble {bubble}"
        )
    ]
    if args.compare:
        costs = m.calibrated()
        said = (
            f"predicted at step {step}'s measured costs (mean F, B, I, W a stage; transfer "
            f"latency {costs.latency:.2f} ms, posting {costs.post:.2f} ms, between items "
            f"{costs.gap:.2f} ms)"
        )
        pred = grid_of(c, costs, "")
        unit = ", ".join(f"{100 * b:.1f}%" for _, b in sorted(plan.bubble.items()))
        said += f": {pred.step:.1f} ms; bubble {_bubble(c, pred.bubble)} (at unit costs {unit})"
        grids.insert(0, replace(pred, said=said))
    return grids


def _bubble(c: Compiled, bubble: dict[int, float]) -> str:
    """Each rank's idle share, as the summary lines say it: `rank 0 27.3%, ...`."""
    return ", ".join(f"{who(c, r)} {100 * b:.1f}%" for r, b in sorted(bubble.items()))

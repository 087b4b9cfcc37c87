"""`schedc render` of pipeline schedules: the pipeline grid (schedc/viz/pipeline.py).

    schedc render schedules/pipeline/tiny_pp4_1f1b.sched -o pp.svg          # the grid
    schedc render a.sched b.sched -o pair.svg       # several, stacked on one time scale

A pipeline schedule draws only its predicted timeline, at the plan's unit costs: the flags
of the data-parallel views (a measured trace, the graph, a window, the cost model in
seconds) are each refused in one line rather than ignored.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedc.cli.common import given, overrides
from schedc.compiler import compile_file
from schedc.errors import UserError
from schedc.lang.nodes import Pipeline
from schedc.lang.parse import parse
from schedc.lang.read import read_source
from schedc.lang.syntax import to_ast
from schedc.viz.dot import write
from schedc.viz.pipeline import grid_of, pipeline_dot, who

# flags a pipeline grid has no use for, and why (the first given is said)
REFUSED = (
    ("--trace", "the pipeline executor writes no trace yet: the grid is predicted only"),
    ("--compare", "the pipeline executor writes no trace yet: the grid is predicted only"),
    ("--step", "the pipeline executor writes no trace yet: the grid is predicted only"),
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
    """Every file a pipeline schedule, each drawn as its grid, stacked on one time scale."""
    first = next(f for f in args.files if is_pipeline(f))
    refuse(args, first)
    compiled = [compile_file(f, overrides(args)) for f in args.files]
    for c in compiled:
        if c.pipeline is None:
            raise UserError(
                f"{c.source.path} is a data-parallel schedule and {first} a pipeline one: "
                "they share no picture; render them apart"
            )
    grids = [grid_of(c) for c in compiled]
    try:
        write(pipeline_dot(grids), out, "neato")
    except OSError as e:
        raise UserError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
    print(f"schedc: wrote {out} (pipeline timeline)")
    for g in grids:
        bubble = ", ".join(f"{who(g, r)} {100 * b:.1f}%" for r, b in sorted(g.plan.bubble.items()))
        print(f"  {g.name}: step {g.plan.step:g} (F = 1 a stage), bubble {bubble}")
    return 0

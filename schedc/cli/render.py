"""`schedc render`: the dependency graph, or a timeline in the seed pictures' style.

    schedc render schedules/ddp_overlap.sched -o ddp.svg                    # the graph
    schedc render schedules/ddp_overlap.sched -o ddp.svg --view timeline    # predicted
    schedc render schedules/tiny_ddp_overlap.sched --trace t.json -o t.svg  # measured
    schedc render a.sched b.sched --view timeline -o pair.svg               # one time scale
    schedc render schedules/pipeline/tiny_pp4_1f1b.sched -o pp.svg          # pipeline grid

The views are drawn by schedc/viz/ (graph.py for `dot`, timeline/ for `neato -n2`).
`-o X.dot` writes the DOT text and needs no Graphviz; svg/png/pdf need Graphviz's programs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from schedc.analysis.calibrate import calibrate
from schedc.analysis.cost import CostModel, check_parameter
from schedc.analysis.trace.compare import only_step, step_times
from schedc.analysis.trace.schema import Trace
from schedc.analysis.trace.stream import load
from schedc.analysis.units import fmt_time, parse_rate, parse_time
from schedc.cli.common import check_distinct, check_output, given, overrides
from schedc.cli.render_pipeline import is_pipeline, render_pipeline
from schedc.compiler import Compiled, compile_file
from schedc.errors import UserError
from schedc.viz.dot import ENGINE, FORMATS, write
from schedc.viz.graph import graph_dot
from schedc.viz.timeline import timeline_dot
from schedc.viz.timeline.panels import panels_for

HELP = "draw the dependency graph or a predicted/measured timeline (Graphviz)"


def add_cost_args(p: argparse.ArgumentParser) -> None:
    d = CostModel()
    g = p.add_argument_group("cost model (predicted timelines; flags > --cost file > defaults)")
    g.add_argument(
        "--cost", metavar="PARAMS.json", help="parameters as `schedc calibrate -o` writes them"
    )
    g.add_argument(
        "--flops",
        metavar="RATE",
        help=f"compute throughput in the schedule's "
        f"compute dtype, FLOP/s: 300T, 3e14 (default bf16 {d.flops_bf16:.3g}, fp32 "
        f"on TF32 {d.flops_tf32:.3g}, fp32 with tf32 off {d.flops_fp32:.3g})",
    )
    g.add_argument(
        "--bandwidth",
        metavar="RATE",
        help=f"bus bandwidth per GPU, B/s: 100G (default {d.bandwidth:.3g})",
    )
    g.add_argument(
        "--inter-bandwidth",
        metavar="RATE",
        help="bus bandwidth of a collective whose group spans nodes, B/s: 12.5G "
        "(default: --bandwidth)",
    )
    g.add_argument(
        "--node-size",
        metavar="N",
        type=int,
        help=f"ranks per node (torchrun --nproc_per_node) (default {d.node_size:g})",
    )
    g.add_argument(
        "--latency",
        metavar="TIME",
        help=f"fixed cost per collective: 10us (default {d.latency:.3g} s)",
    )


def cost_from_args(args: argparse.Namespace, base: CostModel | None = None) -> CostModel:
    """Flags > --cost file > `base` (default: CostModel's defaults)."""
    try:
        base = CostModel.load(args.cost) if args.cost else base or CostModel()
    except ValueError as e:
        raise UserError(f"--cost {e}") from None
    return base.with_(**cost_flags(args))


COST_FLAGS = ("--cost", "--flops", "--bandwidth", "--inter-bandwidth", "--node-size", "--latency")


def default_cost_note(args: argparse.Namespace, file: str) -> str | None:
    """Said when a prediction is priced by the defaults alone: they are an H100-class GPU's,
    and a schedule for CPU ranks (or another GPU) was priced with them without a word (a
    96 us step predicted for a CPU run of milliseconds)."""
    if any(given(args, f) for f in COST_FLAGS):
        return None
    return (
        "schedc: note: priced with the default cost model, an H100-class GPU's; for CPU "
        f"ranks or another GPU, fit one to a run: `schedc run {file} --trace t.json "
        "--probe`, `schedc calibrate t.json -o fit.json`, then --cost fit.json"
    )


def cost_flags(args: argparse.Namespace) -> dict[str, float]:
    """The cost flags given, each read and held to its parameter's range (analysis/cost.py): a
    UserError naming the flag when one is out of it."""
    given = {}
    for name, read in (
        ("flops", parse_rate),
        ("bandwidth", parse_rate),
        ("inter_bandwidth", parse_rate),
        ("node_size", float),
        ("latency", parse_time),
    ):
        text = getattr(args, name)
        if text is None:
            continue
        try:
            given[name] = check_parameter(name, read(text))
        except ValueError as e:
            raise UserError(f"--{name.replace('_', '-')} {text}: {e}") from None
    return given


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE.sched",
        help="a schedule; several draw side by side (graph) or stacked on one time "
        "scale (timeline)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="the picture: .svg, .png, .pdf, or .dot (DOT text, no Graphviz needed)",
    )
    p.add_argument(
        "--view",
        choices=["graph", "timeline"],
        help="graph (default) or timeline (default with --trace, and a pipeline schedule's "
        "only view: its grid)",
    )
    p.add_argument(
        "--trace", metavar="RUN.json", help="draw the measured timeline from `schedc run --trace`"
    )
    p.add_argument("--step", type=int, help="the traced step to draw (default: the last)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="with --trace: the predicted timeline above the measured one, priced by the "
        "cost model fitted to that trace (as `schedc calibrate` fits it) unless --cost is given",
    )
    p.add_argument(
        "--rank",
        type=int,
        help="one rank (default: the graph every rank runs; "
        "timelines: every rank of a trace, every rank whose plan differs, or rank 0 "
        "standing for all)",
    )
    p.add_argument(
        "--window",
        metavar="FROM:TO",
        help="timeline: draw part of the step: mb3: (micro-step 3 to the end), mb1:mb2, 70ms:90ms",
    )
    p.add_argument(
        "--unfold",
        action="store_true",
        help="every op: no folded micro-steps (graph), no grouped layers (timeline)",
    )
    p.add_argument("--model", help="model size (overrides the file; use the run's --model)")
    add_cost_args(p)


def run(args: argparse.Namespace) -> int:
    out = _output(args)
    if any(is_pipeline(f) for f in args.files):
        return render_pipeline(args, out)
    view = _view(args)
    compiled = [compile_file(f, overrides(args)) for f in args.files]
    trace = load(args.trace) if args.trace else None
    for c in compiled:
        if args.rank is not None and not 0 <= args.rank < c.spec.world:
            raise UserError(f"--rank {args.rank}: {c.source.path} has ranks 0..{c.spec.world - 1}")
    report: list[str] = []  # said under `wrote`
    if view == "graph":
        dot = graph_dot(compiled, args.rank, args.unfold)
    else:
        dot, report = _timeline(compiled, trace, args)
    try:
        write(dot, out, ENGINE[view])
    except OSError as e:  # checked at the start, but the disk can fill or the path change
        raise UserError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
    print(f"schedc: wrote {out} ({view})")
    for line in report:
        print(f"  {line}")
    sys.stdout.flush()
    return 0


def _output(args: argparse.Namespace) -> Path:
    """-o, its format told by its extension, writable and none of the inputs."""
    out = Path(args.output)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise UserError(
            f"-o {args.output}: the extension says the format; use one of "
            f"{', '.join('.' + f for f in FORMATS)}"
        )
    check_output("-o", args.output)
    check_distinct(
        ("-o", args.output),
        inputs=(
            *(("a schedule", f) for f in args.files),
            ("--trace", args.trace),
            ("--cost", args.cost),
        ),
    )
    return out


def _view(args: argparse.Namespace) -> str:
    """The view drawn, "graph" or "timeline", once every flag given is one it draws with (a
    bad cost flag or --cost file is said here, before any work)."""
    view = args.view or ("timeline" if args.trace else "graph")
    if args.trace and view == "graph":
        raise UserError("--trace draws a measured timeline; drop --view graph")
    if args.trace and len(args.files) != 1:
        raise UserError("--trace belongs to one schedule; give one FILE.sched")
    if args.window and view == "graph":
        raise UserError("--window crops a timeline; add --view timeline")
    if args.step is not None and not args.trace:
        raise UserError("--step picks a step of a trace; add --trace RUN.json")
    if args.compare and not args.trace:
        raise UserError(
            "--compare sets the predicted timeline beside a measured one; add --trace RUN.json"
        )
    priced = view == "timeline" and (not args.trace or args.compare)
    unused = [f for f in COST_FLAGS if given(args, f)]
    if unused and not priced:
        raise UserError(
            f"{unused[0]} prices a predicted timeline, which "
            + ("a measured one without --compare" if args.trace else "the graph view")
            + " does not draw: add "
            + ("--compare" if args.trace else "--view timeline")
        )
    if priced:
        cost_from_args(args)
    return view


def _timeline(
    compiled: list[Compiled], trace: Trace | None, args: argparse.Namespace
) -> tuple[str, list[str]]:
    """The timeline's DOT text, and the lines said under `wrote` (what each panel shows)."""
    if trace is None and (note := default_cost_note(args, compiled[0].source.path)):
        print(note)
    fitted = (
        _fit_from_trace(compiled[0], trace, args)
        if trace and args.compare and not args.cost
        else None
    )
    panels = panels_for(
        compiled,
        cost_from_args(args, fitted),
        rank=args.rank,
        trace=trace,
        trace_name=args.trace or "",
        step=args.step,
        compare=args.compare,
        cost_note=f"fitted to {Path(args.trace).name}" if fitted else "",
    )
    try:
        dot = timeline_dot(panels, unfold=args.unfold, window=args.window)
    except ValueError as e:
        if not args.window:  # not the user's window: a bug, not a message blaming a flag
            raise
        raise UserError(f"--window {args.window!r}: {e}") from None
    return dot, [line for p in panels for line in p.report()]


def _fit_from_trace(c: Compiled, trace: Trace, args: argparse.Namespace) -> CostModel:
    """--compare without --cost: the prediction is priced by the model `schedc calibrate`
    fits to the very trace it is compared with (defaults would predict a GPU: a 100 us
    strip above a 275 ms CPU step). Says so, and what it fitted, in one line."""
    drawn, step = only_step(trace, args.step)  # the fit prices the step drawn beside it
    fit = calibrate(c, drawn, name=args.trace)
    flags = [
        f"--{k.replace('_', '-')}"
        for k in ("flops", "bandwidth", "inter_bandwidth", "node_size", "latency")
        if getattr(args, k) is not None
    ]
    print(
        f"schedc: no --cost: the prediction uses the cost model fitted to step {step} of "
        f"{args.trace}, the step drawn (as `schedc calibrate` fits it): "
        f"{fit.cost.describe(c.spec.numerics)}"
        + (f"; {', '.join(flags)} as given" if flags else "")
        + "".join(f"; {n}" for n in fit.notes)
    )
    times = step_times(trace)
    if len(times) > 1 and max(times.values()) > 2 * min(times.values()):
        lo, hi = min(times, key=times.__getitem__), max(times, key=times.__getitem__)
        print(
            f"schedc: note: the steps of {args.trace} vary {times[hi] / times[lo]:.1f}x "
            f"(step {lo} {fmt_time(times[lo])}, step {hi} {fmt_time(times[hi])}); "
            f"step {step}, drawn, took {fmt_time(times[step])}: --step N draws another"
        )
    return fit.cost

"""`schedc render`: the dependency graph, or a timeline in the seed pictures' style, as Graphviz.

    schedc render schedules/ddp_overlap.sched -o ddp.svg                    # the graph
    schedc render schedules/ddp_overlap.sched -o ddp.svg --view timeline    # predicted
    schedc render schedules/tiny_ddp_overlap.sched --trace t.json -o t.svg  # measured
    schedc render a.sched b.sched --view timeline -o pair.svg               # one time scale
    schedc calibrate t.json -o params.json                                  # fit the cost model

The graph view is DOT for `dot`: one cluster per stream, nodes labelled with their IR text in
program order, program order as thin grey edges, events (cross-stream waits) dashed and
labelled with what they carry, collectives as coloured hexagons. Repeated micro-steps fold
into one node per stream ("mb1 .. mb30 (x30, same ops)") unless --unfold. The timeline view
(schedc/timeline.py) is DOT with fixed positions for `neato -n2`. `-o X.dot` writes the DOT
text and needs no Graphviz; svg/png/pdf need Graphviz's programs on PATH.
"""

from __future__ import annotations

import shutil
import sys
from collections import defaultdict
from pathlib import Path

from schedc.compiler import Compiled, compile_file
from schedc.ir import Kind, Op

FORMATS = ("svg", "png", "pdf", "dot")
ENGINE = {"graph": "dot", "timeline": "neato"}

# Excalidraw's palette, as in the seed pictures: (fill, stroke)
COLORS = {
    Kind.FWD: ("#a5d8ff", "#1971c2"),
    Kind.BWD: ("#b2f2bb", "#2f9e44"),
    Kind.FREE: ("#f1f3f5", "#868e96"),
    Kind.STEP: ("#dee2e6", "#1e1e1e"),
    Kind.ALLREDUCE: ("#ffc9c9", "#e03131"),
    Kind.REDUCESCATTER: ("#ffc9c9", "#e03131"),
    Kind.ALLGATHER: ("#d0ebff", "#1864ab"),
}
EVENT_COLOR = "#e8590c"
FONT = "Helvetica"


def q(text: str) -> str:
    """A DOT string literal: newlines become centred line breaks; a written "\\l" stays a
    left-justified one (schedc's own texts hold no other backslashes)."""
    return '"' + text.replace('"', '\\"').replace("\n", "\\n") + '"'


def attrs(**kv) -> str:
    return "[" + ", ".join(f"{k}={v}" for k, v in kv.items() if v is not None) + "]"


def describe(c: Compiled) -> str:
    """One line saying what the schedule is: strategy, world, micro-steps."""
    s = c.spec
    k = f"{s.accum} micro-step{'s' if s.accum != 1 else ''} of {s.micro} x {s.seq_len} tokens"
    if s.kind == "ddp":
        st = s.strategy
        how = f"{len(st.buckets)} bucket{'s' if len(st.buckets) != 1 else ''}"
        sync = ", no_sync" if s.no_sync and s.accum > 1 else ""
        return f"DDP, world {s.world}, {k}, {how}{sync}"
    if s.kind == "fsdp":
        st = s.strategy
        return (f"FSDP, world {s.world}, {k}, {len(st.units)} units, prefetch forward "
                f"{st.prefetch_forward} / backward {st.prefetch_backward}")
    return f"one process, {k}, gradients added across micro-steps"


# -- folding repeated micro-steps ----------------------------------------------------------------


def folded_microsteps(c: Compiled, rank: int | None = None) -> range:
    """The middle micro-steps 1 .. k-2 when every one has the same ops on the same streams
    (two or more of them); otherwise an empty range: nothing folds."""
    k = c.spec.accum
    if k < 4:
        return range(0)
    sg = c.graph(rank)
    shape: dict[int, list] = defaultdict(list)
    for stream, ops in sg.programs.items():
        for op in ops:
            if op.mb >= 0:
                shape[op.mb].append((stream, op.kind, op.target, op.phase))
    middle = range(1, k - 1)
    first = shape[middle[0]]
    return middle if all(shape[j] == first for j in middle) else range(0)


def _fold_label(ops: list[Op], folded: range) -> str:
    counts: dict[str, int] = {}
    for op in ops:
        if op.mb == folded[0]:
            counts[op.kind.value] = counts.get(op.kind.value, 0) + 1
    each = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return (f"mb{folded[0]} .. mb{folded[-1]}\n(x{len(folded)}, same ops)\n{each} each")


# -- the graph view -------------------------------------------------------------------------------


def graph_dot(compiled: list[Compiled], rank: int | None = None, unfold: bool = False) -> str:
    """The schedule graph(s) as DOT for `dot`: what runs on which stream and what waits."""
    graph = attrs(rankdir="TB", fontname=q(FONT), fontsize=16, labelloc="t", nodesep="0.3",
                  ranksep="0.22")
    node = attrs(fontname=q(FONT), fontsize=11, shape="box", style=q("rounded,filled"),
                 height="0.3", margin=q("0.08,0.03"))
    out = ["digraph schedc {", f"  graph {graph};", f"  node {node};",
           f"  edge {attrs(fontname=q(FONT), fontsize=9, arrowsize='0.6')};"]
    for i, c in enumerate(compiled):
        out += _graph_body(c, i, rank, unfold, nested=len(compiled) > 1)
    legend = ("grey arrows: program order on a stream; dashed orange: an event, a wait across "
              "streams, labelled with what it carries;<br/>hexagons: collectives (red: "
              "all-reduce and reduce-scatter, blue: all-gather); dashed boxes: frees")
    title = f"{Path(compiled[0].source.path).name}: {describe(compiled[0])}<br/>" \
        if len(compiled) == 1 else ""
    out.append(f'  label=<{_html(title)}<font point-size="11">{legend}</font>>;')
    out.append("}")
    return "\n".join(out) + "\n"


def _graph_body(c: Compiled, index: int, rank: int | None, unfold: bool, nested: bool) -> list[str]:
    sg = c.graph(rank)
    g = sg.g
    folded = range(0) if unfold else folded_microsteps(c, rank)
    ids: dict[Op, str] = {}
    lines: list[str] = []
    pad = "    " if nested else "  "
    if nested:
        lines.append(f"  subgraph cluster_s{index} {{")
        lines.append(f"    label={q(f'{Path(c.source.path).name}: {describe(c)}')}; "
                     "fontsize=14; style=rounded; color=\"#adb5bd\";")
    n = 0
    for stream, ops in sg.programs.items():
        if not ops:
            continue
        lines.append(f"{pad}subgraph cluster_s{index}_{_ident(stream)} {{")
        lines.append(f"{pad}  label={q(f'{stream} stream')}; fontsize=13; "
                     'style="rounded,filled"; fillcolor="#f8f9fa"; color="#ced4da";')
        fold_id = None
        fold_ops = [op for op in ops if op.mb in folded]
        for op in ops:
            if op.mb in folded:
                if fold_id is None:
                    fold_id = f"s{index}n{n}"
                    n += 1
                    style = attrs(label=q(_fold_label(fold_ops, folded)), shape="box3d",
                                  style="filled", fillcolor=q("#fff9db"), color=q("#f08c00"))
                    lines.append(f"{pad}  {fold_id} {style};")
                ids[op] = fold_id
                continue
            ids[op] = f"s{index}n{n}"
            n += 1
            lines.append(f"{pad}  {ids[op]} {_node_style(op)};")
        lines.append(f"{pad}}}")
    edges: dict[tuple[str, str], tuple[str, set[str]]] = {}
    rank_of = {"order": 0, "after": 1, "event": 2}
    for u, v, d in sorted(g.edges(data=True), key=lambda e: (_pos(g, e[1]), _pos(g, e[0]))):
        kind = d.get("sync")
        if not kind or u not in ids or v not in ids or ids[u] == ids[v]:
            continue
        key = (ids[u], ids[v])
        why = set(d.get("needs") or ()) if u.mb not in folded and v.mb not in folded else set()
        old = edges.get(key)
        if old is None or rank_of[kind] > rank_of[old[0]]:
            edges[key] = (kind, why | (old[1] if old else set()))
        else:
            old[1].update(why)
    for (a, b), (kind, why) in edges.items():
        if kind == "event":
            label = q(", ".join(sorted(why))) if why else None
            style = attrs(style="dashed", color=q(EVENT_COLOR), fontcolor=q(EVENT_COLOR),
                          penwidth="1.4", label=label)
            lines.append(f"{pad}{a} -> {b} {style};")
        elif kind == "after":
            lines.append(f"{pad}{a} -> {b} {attrs(style='dotted', color=q('#495057'))};")
        else:
            lines.append(f"{pad}{a} -> {b} {attrs(color=q('#adb5bd'))};")
    if nested:
        lines.append("  }")
    return lines


def _html(text: str) -> str:
    """Escape the few characters HTML-like labels reserve (our <br/> tags pass through)."""
    return text.replace("&", "&amp;").replace("<br/>", "\0").replace("<", "&lt;") \
        .replace(">", "&gt;").replace("\0", "<br/>")


def _pos(g, op: Op) -> tuple:
    d = g.nodes[op]
    return (d.get("seq") if d.get("seq") is not None else 1 << 30, d.get("pos") or 0, str(op))


def _ident(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)


def _node_style(op: Op) -> str:
    fill, stroke = COLORS[op.kind]
    if op.is_collective:
        return attrs(label=q(str(op)), shape="hexagon", style="filled", fillcolor=q(fill),
                     color=q(stroke), penwidth="2", fontcolor=q("#1e1e1e"))
    if op.kind is Kind.FREE:
        return attrs(label=q(str(op)), style=q("rounded,dashed"), color=q(stroke),
                     fontcolor=q(stroke))
    if op.kind is Kind.STEP:
        return attrs(label=q(str(op)), style=q("filled,bold"), fillcolor=q(fill), color=q(stroke))
    return attrs(label=q(str(op)), fillcolor=q(fill), color=q(stroke))


# -- writing files ---------------------------------------------------------------------------------


class GraphvizMissing(Exception):
    pass


def write(dot: str, out: Path, engine: str) -> None:
    """DOT text to `out`, its format named by the extension (.dot needs no Graphviz)."""
    fmt = out.suffix.lstrip(".").lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        out.write_text(dot)
        return
    if shutil.which(engine) is None:
        raise GraphvizMissing(
            f"writing {out.name} needs Graphviz's `{engine}` program, which is not on PATH; "
            "install Graphviz (Debian/Ubuntu: `sudo apt-get install graphviz`, macOS: "
            "`brew install graphviz`, conda: `conda install graphviz`), or write DOT text "
            f"with -o {out.with_suffix('.dot').name} and render it elsewhere")
    import graphviz

    try:
        data = graphviz.pipe(engine, fmt, dot.encode(),
                             neato_no_op=2 if engine == "neato" else None, quiet=True)
    except graphviz.ExecutableNotFound as e:  # on PATH but not runnable
        raise GraphvizMissing(f"cannot run Graphviz's `{engine}`: {e}") from None
    out.write_bytes(data)


def check_output(path: str, flag: str = "-o") -> Path:
    """`path` as a file this process can write, checked before any work so that a typo does
    not cost a compile, a simulation or a layout; a UserError says what is wrong. A missing
    file is created and removed again: the one test that also holds on read-only file
    systems, in /proc, and for root (whom os.access never refuses)."""
    from schedc.commands import UserError

    out = Path(path)
    where = out.parent
    if out.is_dir():
        raise UserError(f"{flag} {path}: is a directory; name a file in it")
    if not where.is_dir():
        what = "not a directory" if where.exists() else "no such directory"
        raise UserError(f"{flag} {path}: {what}: {where}")
    try:
        if out.exists():
            if not out.is_file():
                raise UserError(f"{flag} {path}: not a regular file")
            with open(out, "ab"):  # appends nothing; opening is the test
                pass
        else:
            with open(out, "xb"):
                pass
            out.unlink()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise UserError(f"{flag} {path}: cannot write: {getattr(e, 'strerror', None) or e}"
                        ) from None
    return out


# -- the CLI verbs ---------------------------------------------------------------------------------


def add_cost_args(p) -> None:
    from schedc.cost import CostModel

    d = CostModel()
    g = p.add_argument_group("cost model (predicted timelines; flags > --cost file > defaults)")
    g.add_argument("--cost", metavar="PARAMS.json", help="parameters as `schedc calibrate -o` "
                   "writes them")
    g.add_argument("--flops", metavar="RATE", help=f"compute throughput, FLOP/s: 300T, 3e14 "
                   f"(default {d.flops:.3g})")
    g.add_argument("--bandwidth", metavar="RATE", help=f"bus bandwidth per GPU, B/s: 100G "
                   f"(default {d.bandwidth:.3g})")
    g.add_argument("--latency", metavar="TIME", help=f"fixed cost per collective: 10us "
                   f"(default {d.latency:.3g} s)")


def cost_from_args(args):
    from schedc.commands import UserError
    from schedc.cost import CostModel, parse_rate, parse_time

    try:
        base = CostModel.load(args.cost) if args.cost else CostModel()
        return base.with_(
            flops=parse_rate(args.flops) if args.flops else None,
            bandwidth=parse_rate(args.bandwidth) if args.bandwidth else None,
            latency=parse_time(args.latency) if args.latency is not None else None)
    except (OSError, ValueError) as e:
        raise UserError(f"cost model: {e}") from None


def add_render_args(p) -> None:
    p.add_argument("files", nargs="+", metavar="FILE.sched",
                   help="a schedule; several draw side by side (graph) or stacked on one time "
                   "scale (timeline)")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="the picture: .svg, .png, .pdf, or .dot (DOT text, no Graphviz needed)")
    p.add_argument("--view", choices=["graph", "timeline"],
                   help="graph (default) or timeline (default with --trace)")
    p.add_argument("--trace", metavar="RUN.json",
                   help="draw the measured timeline from `schedc run --trace`")
    p.add_argument("--step", type=int, help="the traced step to draw (default: the last)")
    p.add_argument("--compare", action="store_true",
                   help="with --trace: the predicted timeline above the measured one")
    p.add_argument("--rank", type=int, help="one rank (default: the graph every rank runs; "
                   "timelines: every rank of a trace, every rank whose plan differs, or rank 0 "
                   "standing for all)")
    p.add_argument("--window", metavar="FROM:TO",
                   help="timeline: draw part of the step: mb3: (micro-step 3 to the end), "
                   "mb1:mb2, 70ms:90ms")
    p.add_argument("--unfold", action="store_true",
                   help="every op: no folded micro-steps (graph), no grouped layers (timeline)")
    p.add_argument("--model", help="model size (overrides the file; use the run's --model)")
    add_cost_args(p)


def render_command(args) -> int:
    from schedc.commands import UserError, overrides

    out = Path(args.output)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise UserError(f"-o {args.output}: the extension says the format; use one of "
                        f"{', '.join('.' + f for f in FORMATS)}")
    check_output(args.output)
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
        raise UserError("--compare sets the predicted timeline beside a measured one; add "
                        "--trace RUN.json")
    compiled = [compile_file(f, overrides(args)) for f in args.files]
    for c in compiled:
        if args.rank is not None and not 0 <= args.rank < c.spec.world:
            raise UserError(f"--rank {args.rank}: {c.source.path} has ranks 0..{c.spec.world - 1}")
    if view == "graph":
        dot = graph_dot(compiled, args.rank, args.unfold)
        report = []
    else:
        from schedc.timeline import panels_for, timeline_dot

        panels = panels_for(compiled, args, cost_from_args(args))
        try:
            dot = timeline_dot(panels, unfold=args.unfold, window=args.window)
        except ValueError as e:
            if not args.window:  # not the user's window: a bug, not a message blaming a flag
                raise
            raise UserError(f"--window {args.window!r}: {e}") from None
        report = [line for p in panels for line in p.report()]
    try:
        write(dot, out, ENGINE[view])
    except GraphvizMissing as e:
        raise UserError(str(e)) from None
    except OSError as e:  # checked at the start, but the disk can fill or the path change
        raise UserError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
    print(f"schedc: wrote {out} ({view})")
    for line in report:
        print(f"  {line}")
    sys.stdout.flush()
    return 0


def add_calibrate_args(p) -> None:
    p.add_argument("trace", metavar="RUN.json", help="a trace from `schedc run --trace`")
    p.add_argument("--schedule", metavar="FILE.sched",
                   help="the schedule that was run (default: the one the trace names)")
    p.add_argument("--model", help="model size the run used (if it passed --model)")
    p.add_argument("-o", "--output", metavar="PARAMS.json",
                   help="write the fitted parameters (for render --cost)")


def calibrate_command(args) -> int:
    from schedc.commands import UserError, overrides
    from schedc.trace import TraceError, calibrate, load

    if args.output:
        check_output(args.output)
    try:
        trace = load(args.trace)  # validated: otherData.schedule is a file name if present
        path = args.schedule or (trace.get("otherData") or {}).get("schedule")
        if not path:
            raise UserError(f"{args.trace} does not name its schedule; pass --schedule FILE")
        if not Path(path).exists():
            raise UserError(f"{args.trace} was recorded from {path}, which is not here; pass "
                            "--schedule FILE")
        c = compile_file(path, overrides(args))
        fit = calibrate(c, trace, name=args.trace)
    except TraceError as e:
        raise UserError(str(e)) from None
    print(f"schedc: {args.trace} ({Path(path).name}, world {c.spec.world}): fitted by least "
          "squares")
    print(fit.report())
    if args.output:
        try:
            Path(args.output).write_text(fit.cost.to_json())
        except OSError as e:
            raise UserError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
        print(f"schedc: wrote {args.output} (use: schedc render ... --cost {args.output})")
    return 0

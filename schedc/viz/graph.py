"""The graph view: the dependency graph as DOT for `dot`.

One cluster per stream, nodes labelled with their IR text in program order, program order
as thin grey edges, events (cross-stream waits) dashed and labelled with what they carry,
collectives as coloured hexagons. Repeated micro-steps fold into one node per stream
("mb1 .. mb30 (x30, same ops)") unless `unfold`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op
from schedc.ir.spec import Strategy
from schedc.lang.diagnostics import count
from schedc.passes.graph import ScheduleGraph
from schedc.passes.payloads import Sync
from schedc.viz.dot import EVENT_COLOR, FONT, attrs, colors_of, html, q


def describe(c: Compiled) -> str:
    """One line saying what the schedule is: strategy, world, micro-steps."""
    s = c.spec
    k = f"{s.accum} micro-step{'s' if s.accum != 1 else ''} of {s.micro} x {s.seq_len} tokens"
    if s.kind is Strategy.DDP:
        how = count(len(s.buckets), "bucket")
        sync = ", no_sync" if s.no_sync and s.accum > 1 else ""
        return f"DDP, world {s.world}, {k}, {how}{sync}"
    if s.kind is Strategy.FSDP:
        st = s.fsdp
        what = f"HSDP, mesh {s.mesh} (replicate x shard)" if s.hsdp else "FSDP"
        return (
            f"{what}, world {s.world}, {k}, {count(len(st.units), 'unit')}, prefetch forward "
            f"{st.prefetch_forward} / backward {st.prefetch_backward}"
        )
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
    return f"mb{folded[0]} .. mb{folded[-1]}\n(x{len(folded)}, same ops)\n{each} each"


# -- the graph view -------------------------------------------------------------------------------


def graph_dot(compiled: list[Compiled], rank: int | None = None, unfold: bool = False) -> str:
    """The schedule graph(s) as DOT for `dot`: what runs on which stream and what waits."""
    graph = attrs(
        # newrank: rank the whole graph at once. Without it dot ranks each stream cluster on
        # its own and joins them, and events between clusters may point upward (fsdp_prefetch)
        newrank="true",
        rankdir="TB",
        fontname=q(FONT),
        fontsize=16,
        labelloc="t",
        nodesep="0.3",
        ranksep="0.22",
    )
    node = attrs(
        fontname=q(FONT),
        fontsize=11,
        shape="box",
        style=q("rounded,filled"),
        height="0.3",
        margin=q("0.08,0.03"),
    )
    out = [
        "digraph schedc {",
        f"  graph {graph};",
        f"  node {node};",
        f"  edge {attrs(fontname=q(FONT), fontsize=9, arrowsize='0.6')};",
    ]
    for i, c in enumerate(compiled):
        out += _graph_body(c, i, rank, unfold, nested=len(compiled) > 1)
    legend = _legend(compiled)
    title = (
        f"{Path(compiled[0].source.path).name}: {describe(compiled[0])}<br/>"
        if len(compiled) == 1
        else ""
    )
    out.append(f'  label=<{html(title)}<font point-size="11">{legend}</font>>;')
    out.append("}")
    return "\n".join(out) + "\n"


def _legend(compiled: list[Compiled]) -> str:
    """What the colours and shapes mean: every one the pictures use, and only those (HSDP's
    replicate all-reduce has a colour of its own, recomputed forwards theirs)."""
    kinds = {op.kind for c in compiled for op in c.plan().ops}
    hexagons = "red: all-reduce and reduce-scatter, blue: all-gather"
    if any(c.spec.hsdp for c in compiled):
        hexagons += ", violet: HSDP's all-reduce across replicas"
    boxes = "; violet boxes: recomputed forwards" if Kind.RECOMPUTE in kinds else ""
    return (
        "grey arrows: program order on a stream; dashed orange: an event, a wait across "
        f"streams, labelled with what it carries;<br/>hexagons: collectives ({hexagons}); "
        f"dashed boxes: frees{boxes}"
    )


def _graph_body(c: Compiled, index: int, rank: int | None, unfold: bool, nested: bool) -> list[str]:
    sg = c.graph(rank)
    folded = range(0) if unfold else folded_microsteps(c, rank)
    pad = "    " if nested else "  "
    lines: list[str] = []
    if nested:
        lines.append(f"  subgraph cluster_s{index} {{")
        lines.append(
            f"    label={q(f'{Path(c.source.path).name}: {describe(c)}')}; "
            'fontsize=14; style=rounded; color="#adb5bd";'
        )
    ids = _clusters(c, sg, index, folded, pad, lines)
    lines += _edges(sg, ids, folded, pad)
    if nested:
        lines.append("  }")
    return lines


def _clusters(
    c: Compiled, sg: ScheduleGraph, index: int, folded: range, pad: str, lines: list[str]
) -> dict[Op, str]:
    """One cluster per stream into `lines`, its ops in program order (the folded micro-steps
    one node); each op's node id."""
    ids: dict[Op, str] = {}
    numbers = itertools.count()
    for stream, ops in sg.programs.items():
        if not ops:
            continue
        lines.append(f"{pad}subgraph cluster_s{index}_{_ident(stream)} {{")
        lines.append(
            f"{pad}  label={q(f'{stream} stream')}; fontsize=13; "
            'style="rounded,filled"; fillcolor="#f8f9fa"; color="#ced4da";'
        )
        fold_id = None
        fold_ops = [op for op in ops if op.mb in folded]
        for op in ops:
            if op.mb not in folded:
                ids[op] = f"s{index}n{next(numbers)}"
                lines.append(f"{pad}  {ids[op]} {_node_style(op, c.spec)};")
                continue
            if fold_id is None:
                fold_id = f"s{index}n{next(numbers)}"
                style = attrs(
                    label=q(_fold_label(fold_ops, folded)),
                    shape="box3d",
                    style="filled",
                    fillcolor=q("#fff9db"),
                    color=q("#f08c00"),
                )
                lines.append(f"{pad}  {fold_id} {style};")
            ids[op] = fold_id
        lines.append(f"{pad}}}")
    return ids


def _edges(sg: ScheduleGraph, ids: dict[Op, str], folded: range, pad: str) -> list[str]:
    """Program order, `after` waits and events between the nodes drawn: one edge per pair
    of nodes, drawn as the strongest wait between them, labelled with what events carry."""
    edges: dict[tuple[str, str], tuple[Sync, set[str]]] = {}
    rank_of = {Sync.ORDER: 0, Sync.AFTER: 1, Sync.EVENT: 2}
    for u, v, d in sorted(sg.deps(), key=lambda e: (_pos(sg, e[1]), _pos(sg, e[0]))):
        kind = d.sync
        if not kind or u not in ids or v not in ids or ids[u] == ids[v]:
            continue
        key = (ids[u], ids[v])
        why = {n.value for n in d.needs} if u.mb not in folded and v.mb not in folded else set()
        old = edges.get(key)
        if old is None or rank_of[kind] > rank_of[old[0]]:
            edges[key] = (kind, why | (old[1] if old else set()))
        else:
            old[1].update(why)
    lines = []
    for (a, b), (kind, why) in edges.items():
        if kind is Sync.EVENT:
            label = q(", ".join(sorted(why))) if why else None
            style = attrs(
                style="dashed",
                color=q(EVENT_COLOR),
                fontcolor=q(EVENT_COLOR),
                penwidth="1.4",
                label=label,
            )
            lines.append(f"{pad}{a} -> {b} {style};")
        elif kind is Sync.AFTER:
            lines.append(f"{pad}{a} -> {b} {attrs(style='dotted', color=q('#495057'))};")
        else:
            lines.append(f"{pad}{a} -> {b} {attrs(color=q('#adb5bd'))};")
    return lines


def _pos(sg: ScheduleGraph, op: Op) -> tuple[int, int, str]:
    d = sg.node(op)
    return (d.seq if d.seq is not None else 1 << 30, max(d.pos, 0), str(op))


def _ident(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)


def _node_style(op: Op, spec) -> str:
    fill, stroke = colors_of(spec, op)
    if op.is_collective:
        return attrs(
            label=q(str(op)),
            shape="hexagon",
            style="filled",
            fillcolor=q(fill),
            color=q(stroke),
            penwidth="2",
            fontcolor=q("#1e1e1e"),
        )
    if op.kind is Kind.FREE:
        return attrs(
            label=q(str(op)), style=q("rounded,dashed"), color=q(stroke), fontcolor=q(stroke)
        )
    if op.kind is Kind.STEP:
        return attrs(label=q(str(op)), style=q("filled,bold"), fillcolor=q(fill), color=q(stroke))
    return attrs(label=q(str(op)), fillcolor=q(fill), color=q(stroke))

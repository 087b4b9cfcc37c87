"""Text forms of each stage, for `schedc check --dump ast|graph|program|plan` and golden files.

`program` prints .sched `program` blocks that compile back to the same plan: paste them
into a schedule to take control of a stream's order and waits.
"""

from __future__ import annotations

import dataclasses

from schedc.ir.plan import Plan
from schedc.ir.source import Span
from schedc.lang.diagnostics import count
from schedc.lang.syntax import Schedule
from schedc.passes.graph import ScheduleGraph
from schedc.passes.payloads import Sync, said


def dump_ast(ast: Schedule) -> str:
    lines: list[str] = []

    def walk(node, indent: int, label: str = "") -> None:
        pad = "  " * indent + (f"{label}: " if label else "")
        if isinstance(node, tuple):
            if not node:
                lines.append(f"{pad}()")
                return
            lines.append(f"{pad}[")
            for item in node:
                walk(item, indent + 1)
            lines.append("  " * indent + "]")
            return
        if not dataclasses.is_dataclass(node):
            lines.append(f"{pad}{node!r}")
            return
        fields = [f for f in dataclasses.fields(node) if f.name not in ("span", "source")]
        leaf = all(
            not dataclasses.is_dataclass(getattr(node, f.name))
            and not isinstance(getattr(node, f.name), tuple)
            for f in fields
        )
        span = getattr(node, "span", None)
        at = f" @{span.line}:{span.col}" if isinstance(span, Span) else ""
        if leaf:
            args = ", ".join(f"{f.name}={getattr(node, f.name)!r}" for f in fields)
            lines.append(f"{pad}{type(node).__name__}({args}){at}")
            return
        lines.append(f"{pad}{type(node).__name__}{at}")
        for f in fields:
            walk(getattr(node, f.name), indent + 1, f.name)

    for stmt in ast.stmts:
        walk(stmt, 0)
    return "\n".join(lines)


def dump_graph(sg: ScheduleGraph) -> str:
    g = sg.g
    n_needs = sum(1 for _ in sg.needs())
    lines = [
        f"# graph: {count(g.number_of_nodes(), 'op')}, {count(len(sg.programs), 'stream')}, "
        f"{count(n_needs, 'need')}, {count(len(sg.events()), 'event')}"
    ]
    for stream, ops in sg.programs.items():
        for op in ops:
            lines.append(f"{stream:<8} {op}")
            for p, d in sorted(sg.preds(op), key=lambda pd: sg.node(pd[0]).seq or 0):
                why = said(d.needs) or "order"
                mark = "  <- event" if d.sync is Sync.EVENT else ""
                if d.needs or d.sync is Sync.EVENT:
                    lines.append(f"{'':<8}   needs {p} ({why}){mark}")
    return "\n".join(lines)


def dump_program(sg: ScheduleGraph) -> str:
    """The graph's streams as `program` blocks, waits written as `after`."""
    out = []
    for stream, ops in sg.programs.items():
        if not ops:
            continue
        out.append(f"program {stream} {{")
        for op in ops:
            waits = [p for p, d in sg.preds(op) if d.sync is Sync.EVENT]
            after = f" after {', '.join(str(p) for p in waits)}" if waits else ""
            out.append(f"  {op}{after}")
        out.append("}")
    return "\n".join(out)


def dump_plan(plan: Plan) -> str:
    return plan.render()

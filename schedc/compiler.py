"""The whole compiler in one function; every CLI verb goes through it.

    source -> parse -> to_ast -> resolve -> build_graphs -> check -> lower

Nothing here imports torch: a schedule can be checked, dumped and drawn on any machine.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from schedc.check import check
from schedc.errors import Diagnostic
from schedc.graph import ScheduleGraph, build_graphs
from schedc.lower import Plan, lower
from schedc.memory import MemoryReport, predict
from schedc.parse import parse
from schedc.resolve import Overrides, Spec, resolve
from schedc.source import Source
from schedc.syntax import Schedule, to_ast


@dataclass(frozen=True)
class Compiled:
    source: Source
    ast: Schedule
    spec: Spec
    graphs: dict[int | None, ScheduleGraph]  # None: the graph of every rank without programs
    plans: dict[int | None, Plan]
    warnings: tuple[Diagnostic, ...]

    def graph(self, rank: int | None = None) -> ScheduleGraph:
        return self.graphs.get(rank, self.graphs[None])

    def plan(self, rank: int | None = None) -> Plan:
        return self.plans.get(rank, self.plans[None])

    @cached_property
    def memory(self) -> MemoryReport:
        return predict(self.spec, self.plan())


def compile_source(source: Source, overrides: Overrides = Overrides()) -> Compiled:
    with no_cyclic_gc():
        ast = to_ast(parse(source), source)  # grammar/schedc.lark -> frozen AST with spans
        spec, warnings = resolve(ast, overrides)  # names, values, coverage, batch arithmetic
        graphs = build_graphs(spec)  # networkx DiGraph of ops: needs, streams, events
        diag = check(spec, graphs)  # streams, events, gradients, sharding, memory, SPMD
        diag.extend(warnings)
        diag.raise_if_any()
        plans = {rank: lower(g) for rank, g in graphs.items()}  # per-rank instruction lists
        return Compiled(source, ast, spec, graphs, plans, tuple(diag.warnings))


@contextmanager
def no_cyclic_gc():
    """Pause the cyclic garbage collector while a schedule compiles.

    A step's graph is hundreds of thousands of small live objects (nodes, edge dicts,
    ops), none of them garbage; every full collection walks them all, which made compile
    time grow faster than the number of ops (43% of a 20,000-op compile). Reference
    counting still frees memory; cycles left behind are collected once the GC resumes.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_file(path: str | Path, overrides: Overrides = Overrides()) -> Compiled:
    return compile_source(Source.read(path), overrides)


def compile_text(text: str, path: str = "<input>", overrides: Overrides = Overrides()) -> Compiled:
    return compile_source(Source.from_string(text, path), overrides)

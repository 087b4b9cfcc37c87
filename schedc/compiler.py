"""The whole compiler in one function; every CLI verb goes through it.

    source -> parse -> to_ast -> resolve -> build_graphs -> check -> lower -> bind -> prove
                               a pipeline -> generate -> check -> simulate -> bind -> prove

Both end in every rank's bound plan (ir/bound.py) and the one proof over them; a process
binds once (`Compiled.bound`: the proof's own, where it ran).

Nothing here imports torch: a schedule can be checked, dumped and drawn on any machine.
"""

from __future__ import annotations

import gc
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.errors import UserError
from schedc.ir.bound import Bound
from schedc.ir.plan import Plan
from schedc.ir.source import Source
from schedc.ir.spec import Spec
from schedc.lang.diagnostics import Diagnostic, Diagnostics
from schedc.lang.parse import parse
from schedc.lang.read import read_source, source_from_text
from schedc.lang.resolve import Overrides, resolve
from schedc.lang.syntax import Schedule, to_ast
from schedc.passes.bind import bind
from schedc.passes.check import check_graphs, check_plans, check_proof
from schedc.passes.dump import dump_ast, dump_graph, dump_plan, dump_program
from schedc.passes.graph import ScheduleGraph, build_graphs
from schedc.passes.lower import lower
from schedc.passes.memory import MemoryReport, predict
from schedc.passes.pipeline_bind import bind_pipeline, bind_rank
from schedc.passes.pipeline_memory import check_budget, predict_pipeline
from schedc.passes.pipeline_plan import PipelinePlan, plan_pipeline
from schedc.passes.prove import Proof


@dataclass(frozen=True)
class Compiled:
    source: Source
    ast: Schedule
    spec: Spec
    graphs: dict[int | None, ScheduleGraph]  # None: the graph of every rank without programs
    plans: dict[int | None, Plan]
    memories: dict[int | None, MemoryReport]  # predicted per plan
    warnings: tuple[Diagnostic, ...]
    proof: Proof | None = None  # None: compiled without the proof (`prove=False`)
    # a pipeline schedule's proven programs; it has no DP graphs or memories yet
    pipeline: PipelinePlan | None = None
    # every rank's bound plan, as the proof read them (empty: compiled without the proof)
    bounds: tuple[Bound, ...] = ()

    def graph(self, rank: int | None = None) -> ScheduleGraph:
        self.require_dp("a dependency graph")
        return self.graphs.get(rank, self.graphs[None])

    def plan(self, rank: int | None = None) -> Plan:
        """Rank `rank`'s plan (None: the one every rank without a program of its own runs);
        a pipeline's is its global rank's, bound (passes/pipeline_bind.py)."""
        if self.pipeline is not None:
            return self.bound(rank or 0).plan
        return self.plans.get(rank, self.plans[None])

    def require_dp(self, what: str) -> None:
        """A UserError where a verb needs what only data-parallel schedules have yet (the
        one place that says so: render, run, export and tune all reach it)."""
        if self.pipeline is not None:
            raise UserError(
                f"{self.source.path} is a pipeline schedule: {what} of pipeline stages is "
                "not built yet (schedc check proves it and prints its programs: "
                "--dump pipeline)"
            )

    def bound(self, rank: int) -> Bound:
        """Rank `rank`'s plan with its operands: what its executor runs (ir/bound.py), the
        proof's own where it bound them (a process binds once)."""
        if self.bounds:
            return self.bounds[rank]
        if self.pipeline is not None:
            pipe, programs = self.pipeline.pipeline, self.pipeline.programs
            return bind_rank(self.spec, pipe, programs, rank)
        return bind(self.spec, self.plan(rank), rank)

    @property
    def plans_digest(self) -> str:
        """A digest of every plan (a pipeline's programs) in its text form. Bound plans are
        the binder's function of these and of the schedule's meaning (passes/agree.py), so
        ranks that agree on both run plans one proof covers (exec/train.py)."""
        plans = (
            self.pipeline.dump()
            if self.pipeline is not None
            else "\n".join(f"{r}\n{dump_plan(p)}" for r, p in sorted(
                self.plans.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))
        )  # fmt: skip
        return hashlib.sha256(plans.encode()).hexdigest()[:16]

    def dump(self, stage: str, rank: int | None = None) -> str:
        """A stage's text form (`schedc check --dump`): ast, graph, program or plan."""
        if stage == "ast":
            return dump_ast(self.ast)
        if stage == "pipeline":
            if self.pipeline is None:
                raise UserError(f"{self.source.path} has no pipeline block to dump")
            return self.pipeline.dump()
        if stage == "plan":
            return dump_plan(self.plan(rank))
        return {"graph": dump_graph, "program": dump_program}[stage](self.graph(rank))

    @property
    def memory(self) -> MemoryReport:
        """The predicted memory of the plan every rank without a program of its own runs."""
        self.require_dp("a memory prediction")
        return self.memories[None]


def compile_source(
    source: Source, overrides: Overrides = Overrides(), prove: bool = True
) -> Compiled:
    proof: Proof | None = None
    bounds: tuple[Bound, ...] = ()
    with no_cyclic_gc():
        ast = to_ast(parse(source), source)  # grammar/schedc.lark -> frozen AST with spans
        spec, warnings = resolve(ast, overrides)  # names, values, coverage, batch arithmetic
        if spec.pipeline is not None:  # stages: generated, proven and timed instead
            return _compile_pipeline(source, ast, spec, warnings, prove)
        graphs = build_graphs(spec)  # networkx DiGraph of ops: needs, streams, events
        diag = Diagnostics(source)
        diag.extend(warnings)
        if check_graphs(spec, graphs, diag):  # placement, cycles, needs, events, frees
            plans = {rank: lower(g) for rank, g in graphs.items()}  # per-rank instructions
            memory = {rank: predict(spec, plan) for rank, plan in plans.items()}
            check_plans(spec, graphs, plans, memory, diag)  # SPMD order, budget
            if prove and not diag.errors:  # every rank's plan computes one process's update
                memo: dict = {}  # one bound instruction per instruction and group
                bounds = tuple(
                    bind(spec, plans.get(r, plans[None]), r, memo) for r in range(spec.world)
                )
                proof = check_proof(spec, list(bounds), diag)
        diag.raise_if_any()
        warned = tuple(diag.warnings)
        return Compiled(source, ast, spec, graphs, plans, memory, warned, proof, None, bounds)


def _compile_pipeline(
    source: Source, ast: Schedule, spec: Spec, warnings: list, prove: bool
) -> Compiled:
    """A pipeline schedule: its named schedule's programs, proven free of deadlock, timed,
    and bound to every rank and proven to compute one process's update."""
    diag = Diagnostics(source)
    diag.extend(warnings)
    pipeline, proof, bounds = plan_pipeline(spec, diag), None, []
    if pipeline is not None:  # each rank's memory along its program, and the budget
        memory = predict_pipeline(spec, pipeline.pipeline, pipeline.programs)
        check_budget(spec, memory, diag)
        pipeline = replace(pipeline, memory=memory)
        if prove and not diag.errors:  # every update is one process's
            bounds = bind_pipeline(spec, pipeline.pipeline, pipeline.programs)
            proof = check_proof(spec, bounds, diag)
    diag.raise_if_any()
    warned = tuple(diag.warnings)
    return Compiled(source, ast, spec, {}, {}, {}, warned, proof, pipeline, tuple(bounds))


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


def compile_file(
    path: str | Path, overrides: Overrides = Overrides(), prove: bool = True
) -> Compiled:
    return compile_source(read_source(path), overrides, prove)


def compile_text(
    text: str, path: str = "<input>", overrides: Overrides = Overrides(), prove: bool = True
) -> Compiled:
    return compile_source(source_from_text(text, path), overrides, prove)

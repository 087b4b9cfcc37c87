"""A schedule's pipeline: its named schedule generated (or its written programs taken), proven
and timed, every finding located in the file.

    plan_pipeline(spec, diag) -> PipelinePlan | None     # None: findings were reported

The programs come from passes/pipeline_gen.py or from the file (`program on rank N`,
lang/resolve/pipeline_programs.py), are proven by passes/pipeline_check.py and
timed by passes/pipeline_sim.py over the proof's happens-before graph, at the generator's
unit costs (F = 1, B = 2, I = W = 1 per stage, transfers free): the same for every stage,
so the bubble is the schedule's, not the split's (a stage with more layers than another
is not yet timed longer; the cost model's per-layer times are a layer above the compiler).
A micro-batch count the schedule cannot run is located at `microbatches` (else at the
batch's split); a finding about the generated programs at `schedule`, with the ranks'
programs side by side in a note. A finding about written programs is at the first item it
marks (a finding that marks none, a rank that never runs an action, at that rank's
`program`), with a note at each other item it marks and the ranks' programs side by side
around them.

Written transfers may name communicators (`:c1`), which the proof takes as FIFO queues of
their own, as NCCL runs two communicators. schedc's executor issues every transfer on the
pipeline's one group, so programs that name another are proven a second time as run, on one
queue, and the plan holds them as run: the programs the proof read are the programs that
run (the executor keys a received tensor by its action, which names its communicator).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from textwrap import indent

import networkx as nx

from schedc.ir.op import DEFAULT_COMM, Kind
from schedc.ir.pipeline import (
    Pipeline,
    Programs,
    Written,
    actions,
    backward_kind,
    format_item,
    side_by_side,
    step_actions,
)
from schedc.ir.source import Span
from schedc.ir.spec import PipelineSpec, Spec, WrittenPrograms
from schedc.lang.diagnostics import MAX_KEPT, Diagnostic, Diagnostics, Note
from schedc.lang.resolve import MAX_OPS
from schedc.passes.memory import MemoryReport
from schedc.passes.pipeline_check import Finding, prove
from schedc.passes.pipeline_gen import COSTS, Request, generate, request_errors
from schedc.passes.pipeline_sim import Costs, simulate


@dataclass(frozen=True)
class PipelinePlan:
    """The proven per-rank programs of a pipeline schedule, and their timing."""

    pipeline: Pipeline
    programs: Programs  # pipeline rank -> items in issue order
    costs: Costs
    step: float  # the simulated step, in units of one stage's forward
    bubble: dict[int, float]  # pipeline rank -> idle share of the step
    # pipeline rank -> its predicted memory (passes/pipeline_memory.py), set by the compiler
    memory: dict[int, MemoryReport] = field(default_factory=dict, compare=False)
    # the proof's happens-before graph the bubble was timed over (as run), for whoever times
    # the programs again at other costs (viz/pipeline.py, tune/pipeline.py)
    graph: nx.DiGraph = field(default_factory=nx.DiGraph, compare=False, repr=False)

    @property
    def cost_words(self) -> str:
        """The costs the bubble was simulated at, as the summary says them."""
        c = self.costs
        split = backward_kind(a for p in self.programs.values() for a in actions(p)) is Kind.I
        kinds = f"F {c.f:g}, I {c.i:g}, W {c.w:g}" if split else f"F {c.f:g}, B {c.b:g}"
        return f"{kinds} a stage, transfers free"

    def dump(self) -> str:
        """Every rank's program side by side, one item a row (`schedc check --dump
        pipeline`)."""
        return side_by_side(self.programs, sorted(self.programs), {})

    def rank_lines(self) -> list[str]:
        """Each rank's program in one line of its text form (which parses back)."""
        return [
            f"rank {r}: {' '.join(format_item(i) for i in p)}"
            for r, p in sorted(self.programs.items())
        ]


AROUND = 3  # rows shown around each marked item in a finding's side-by-side note


def plan_pipeline(spec: Spec, diag: Diagnostics) -> PipelinePlan | None:
    """Generate (or take the written), prove and time the pipeline; None after reporting
    what it cannot run."""
    ps = spec.pipeline
    assert ps is not None
    if ps.written is not None:
        return _plan_written(spec, ps, ps.written, diag)
    assert not isinstance(ps.schedule, Written)
    req = Request(ps.schedule, ps.degree, spec.accum, len(ps.stages) // ps.degree)
    if _too_many(spec, req.pipeline(), req.schedule.splits_backward, diag):
        return None
    if errors := request_errors(req):
        note = (Note("the pipeline is declared here", ps.span),)
        diag.extend([replace(d, span=_at_microbatches(spec), notes=note) for d in errors])
        return None
    gen = generate(req)
    proof = prove(gen.pipeline, gen.programs)
    if proof.findings:  # proven for every size in tests/passes/test_pipeline.py; said if not
        where: Span = ps.where.get("schedule", ps.span)
        title = "the generated programs"
        diag.extend(
            [_located(f, gen.programs, title, lambda _: (where, ())) for f in proof.findings]
        )
        return None
    timing = simulate(proof.graph, COSTS)
    return PipelinePlan(
        gen.pipeline, gen.programs, COSTS, timing.step, timing.bubble, graph=proof.graph
    )


def _plan_written(
    spec: Spec, ps: PipelineSpec, w: WrittenPrograms, diag: Diagnostics
) -> PipelinePlan | None:
    """The programs as written, proven (as written, then as run on one communicator)."""
    pipe = ps.pipeline(spec.accum)
    acts = [a for p in w.programs.values() for a in actions(p)]
    split = backward_kind(acts) is Kind.I
    if _too_many(spec, pipe, split, diag, len(acts)) or _too_few(pipe, w, ps, diag):
        return None
    proof = prove(pipe, w.programs)
    title = "the ranks' programs, side by side"
    # what runs: schedc's executor issues every transfer on the pipeline's one group, so the
    # programs as run name no other communicator; they are what is proven, timed and run
    runs = {r: [tuple(a._replace(comm=DEFAULT_COMM) for a in i) for i in p]
            for r, p in w.programs.items()}  # fmt: skip
    if not proof.findings and runs != w.programs:
        proof = prove(pipe, runs)
        title = (
            "as run: schedc's executor issues every transfer on the pipeline's one group "
            "(P2P on 'pp'), one FIFO queue where the programs name more; the programs"
        )
    if proof.findings:
        for f in proof.findings[:MAX_KEPT]:
            diag.extend([_located(f, w.programs, title, lambda f: _spans(f, w, ps.span))])
        return None
    timing = simulate(proof.graph, COSTS)
    return PipelinePlan(pipe, runs, COSTS, timing.step, timing.bubble, graph=proof.graph)


def _at_microbatches(spec: Spec) -> Span:
    """Where the micro-batch count is written (or the batch's split it is made from)."""
    ps = spec.pipeline
    assert ps is not None
    at = ps.where.get("microbatches") or spec.where.get("micro") or spec.where.get("accumulate")
    return at or ps.span


def _too_many(spec: Spec, pipe: Pipeline, split: bool, diag: Diagnostics, written: int = 0) -> bool:
    """[value-range]: a step of more actions than schedc proves, the DP graph's bound
    (MAX_OPS): generating, proving, timing and the ledger each walk every action (linear;
    at the bound about 3 s on a 2-core CPU), so the bound is on what would be built, before
    any of it is."""
    computes, transfers = step_actions(pipe, split)
    if max(computes + transfers, written) <= MAX_OPS:
        return False
    if written > computes + transfers:
        what = f"the programs hold {written:,} actions"
    else:
        what = (
            f"{pipe.stages:,} stages x {pipe.microbatches:,} micro-batches make "
            f"{computes + transfers:,} actions a step ({computes:,} computes, {transfers:,} "
            "transfers)"
        )
    assert spec.pipeline is not None
    diag.error(
        "value-range",
        f"{what}; schedc proves at most {MAX_OPS:,}",
        _at_microbatches(spec),
        hint="fewer micro-batches (a larger `micro`), or fewer stages",
        notes=(Note("the pipeline is declared here", spec.pipeline.span),),
    )
    return True


def _too_few(pipe: Pipeline, w: WrittenPrograms, ps: PipelineSpec, diag: Diagnostics) -> bool:
    """Programs far short of every stage's F and B for every micro-batch, said in one
    diagnostic rather than one a missing action (`microbatches 1000000` and a page of
    programs would otherwise be millions of findings)."""
    computes = sum(1 for p in w.programs.values() for a in actions(p) if not a.kind.is_p2p)
    need = 2 * pipe.stages * pipe.microbatches
    if need - computes <= MAX_KEPT:
        return False
    diag.error(
        "pp-once",
        f"the programs run {computes:,} computes; {pipe.stages} stages x "
        f"{pipe.microbatches:,} micro-batches need at least {need:,} (an F and a B, or an F, "
        "I and W, of each stage for each micro-batch)",
        ps.where.get("microbatches", ps.span),
        hint="write the programs for the pipeline's micro-batches, or lower microbatches",
    )
    return True


Place = Callable[[Finding], tuple[Span, tuple[Note, ...]]]


def _located(f: Finding, programs: Programs, title: str, place: Place) -> Diagnostic:
    """A finding at its place in the file, with the marked ranks' programs side by side."""
    span, notes = place(f)
    if f.marks:
        shown = side_by_side(programs, f.ranks, f.marks, AROUND)
        notes = (*notes, Note(f"{title}:\n{indent(shown, '    ')}"))
    return replace(f.diagnostic, span=span, notes=notes)


def _spans(f: Finding, w: WrittenPrograms, head: Span) -> tuple[Span, tuple[Note, ...]]:
    """The first item a finding marks, and a note at each other (a finding that marks none
    is at the `program` of the rank it is about, else at the pipeline)."""
    if not f.marks:
        return (w.heads.get(f.rank, head) if f.rank is not None else head), ()
    (first, *rest) = f.marks
    notes = tuple(
        Note(
            f"rank {r}, item {i}: {format_item(w.programs[r][i])}{f.marks[(r, i)]}", w.items[(r, i)]
        )
        for r, i in rest
    )
    return w.items[first], notes

"""A schedule's pipeline: its named schedule generated, proven and timed, every finding
located in the file.

    plan_pipeline(spec, diag) -> PipelinePlan | None     # None: findings were reported

The programs come from passes/pipeline_gen.py, are proven by passes/pipeline_check.py and
timed by passes/pipeline_sim.py over the proof's happens-before graph, at the generator's
unit costs (F = 1, B = 2, I = W = 1 per stage, transfers free): the same for every stage,
so the bubble is the schedule's, not the split's (a stage with more layers than another
is not yet timed longer; the cost model's per-layer times are a layer above the compiler).
A micro-batch count the schedule cannot run is located at `microbatches` (else at the
batch's split); a finding about the generated programs at `schedule`, with the ranks'
programs side by side in a note.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from schedc.ir.pipeline import Kind, Pipeline, Programs, format_item, side_by_side
from schedc.ir.source import Span
from schedc.ir.spec import Spec
from schedc.lang.diagnostics import Diagnostics, Note
from schedc.passes.pipeline_check import prove
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

    @property
    def cost_words(self) -> str:
        """The costs the bubble was simulated at, as the summary says them."""
        c = self.costs
        split = any(a.kind is Kind.I for p in self.programs.values() for i in p for a in i)
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


def plan_pipeline(spec: Spec, diag: Diagnostics) -> PipelinePlan | None:
    """Generate, prove and time the pipeline; None after reporting what it cannot run."""
    ps = spec.pipeline
    assert ps is not None
    req = Request(ps.schedule, ps.degree, spec.accum, len(ps.stages) // ps.degree)
    at = ps.where.get("microbatches") or spec.where.get("micro") or spec.where.get("accumulate")
    if errors := request_errors(req):
        note = (Note("the pipeline is declared here", ps.span),)
        diag.extend([replace(d, span=at or ps.span, notes=note) for d in errors])
        return None
    gen = generate(req)
    proof = prove(gen.pipeline, gen.programs)
    if proof.findings:  # proven for every size in tests/passes/test_pipeline.py; said if not
        where: Span = ps.where.get("schedule", ps.span)
        for f in proof.findings:
            shown = side_by_side(gen.programs, f.ranks, f.marks) if f.marks else ""
            notes = (Note(f"the generated programs:\n{shown}"),) if shown else ()
            diag.extend([replace(f.diagnostic, span=where, notes=notes)])
        return None
    timing = simulate(proof.graph, COSTS)
    return PipelinePlan(gen.pipeline, gen.programs, COSTS, timing.step, timing.bubble)

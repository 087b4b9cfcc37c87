"""What a timeline draws: a `Panel` per timeline, predicted (simulated) or measured (read
from a trace), with its hidden/exposed split of communication."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from schedc.analysis.cost import CostModel
from schedc.analysis.overlap import Overlap, overlap
from schedc.analysis.simulate import Timeline, simulate
from schedc.analysis.trace.compare import measured
from schedc.analysis.trace.schema import Trace
from schedc.compiler import Compiled


@dataclass
class Panel:
    """One timeline to draw: what it is, when each op ran, and its hidden/exposed split."""

    compiled: Compiled
    timeline: Timeline
    overlap: dict[int, Overlap]

    @classmethod
    def of(cls, compiled: Compiled, tl: Timeline) -> Panel:
        return cls(compiled, tl, overlap(tl))

    @property
    def name(self) -> str:
        return Path(self.compiled.source.path).name

    def subtitle(self) -> str:
        tl = self.timeline
        who = (
            f"rank {tl.ranks[0]} shown; every rank of {tl.spec.world} runs the same plan"
            if tl.every_rank
            else f"rank{'s' if len(tl.ranks) > 1 else ''} {', '.join(map(str, tl.ranks))}"
        )
        return f"{tl.source} ({tl.note}); {who}"

    def report(self) -> list[str]:
        head = f"{self.name}, {self.timeline.source}:"
        who = "every rank" if self.timeline.every_rank else "rank {}"
        return [f"{head} {who.format(r)}: {ov.describe()}" for r, ov in self.overlap.items()]


def panels_for(
    compiled: list[Compiled],
    cost: CostModel,
    *,
    rank: int | None = None,
    trace: Trace | None = None,
    trace_name: str = "trace",
    step: int | None = None,
    compare: bool = False,
    cost_note: str = "",
) -> list[Panel]:
    """The panels a timeline draws: predicted for each schedule, or the measured step of
    `trace` (with the prediction above it when `compare`); one rank, or all. `cost_note`
    says where the cost model came from, in the predicted panels' subtitles."""
    ranks = [rank] if rank is not None else None
    if trace is None:
        return [Panel.of(c, simulate(c, cost, ranks)) for c in compiled]
    c = compiled[0]
    tl = measured(c, trace, step, ranks, name=trace_name)
    panels = []
    if compare:
        predicted = simulate(c, cost, ranks)
        if cost_note:
            predicted = replace(predicted, note=f"{predicted.note}; {cost_note}")
        panels.append(Panel.of(c, predicted))
    return panels + [Panel.of(c, tl)]

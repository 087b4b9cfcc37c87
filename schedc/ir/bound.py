"""A plan bound to one rank: every operand its instructions compute with, said in the plan.

A lowered plan (ir/plan.py) is one text for every rank without a program of its own. Bound
to rank r (passes/bind.py), it also says what r's instructions read and divide by. The
executor takes these from the bound plan and from nowhere else, and the proof
(passes/prove.py) checks exactly these, so the two cannot disagree:

    batch[m]        the positions (first, count) of the step's global batch that micro-step
                    m reads: model/batching.py's sequence_ids for this rank
    loss_scale      the multiplier of each micro-step's mean loss (1/k: accumulation)
    grad_keys[m]    FSDP: the unsharded gradient micro-step m's backward adds into (one key
                    for every micro-step under no_sync, unless it upcasts)
    folds[layer]    FSDP under no_sync's upcast: the units whose micro-step gradient this
                    layer's backward folds into the accumulator (it is their last writer)
    buckets         the flat gradient buffers of a replicated schedule, each with its
                    parameters in flat order (one bucket of every parameter on one rank); a
                    parameter in no bucket keeps a gradient of its own that nothing reduces
    shard           FSDP: which chunk of every unit's padded flat parameter this rank holds
                    and updates
    steps           the optimizer steps the plan holds: 1, run once per step (the proof
                    also reads plans unrolled over steps)
    params          a pipeline rank: the parameters it holds and updates (its stages'; empty:
                    every parameter); its batch is its replica's, its loss scale the last
                    stage's (passes/pipeline_bind.py)
    units           FSDP: each unit the rank holds (per stage: the tied wte's on both ends),
                    by the name its collectives target, with its parameters in the order
                    its padded flat parameter lays them out (model/arch.py flat_order:
                    decayed first): the layout its gathers and reduce-scatters move in
                    chunks, which every member must share
    Instr.group     every collective: the ranks of its process group, in group order (a
                    reduce-scatter's chunk p goes to group[p], an all-gather's comes from it);
                    a pipeline transfer: (sender, receiver) as pipeline ranks of the rank's
                    replica, global rank pipeline rank x dp + replica (the same instruction
                    on every replica)
    Instr.divisor   every reduction: what each member's contribution is divided by before
                    the sum (an all-gather's is 1)

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from schedc.ir.plan import Plan


@dataclass(frozen=True)
class Bound:
    """One rank's plan with its operands (the module docstring)."""

    rank: int
    plan: Plan
    batch: tuple[tuple[int, int], ...]
    loss_scale: Fraction
    buckets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    grad_keys: tuple[int, ...] = ()
    folds: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shard: int | None = None
    steps: int = 1  # optimizer steps the plan holds (more: a plan unrolled over steps)
    params: tuple[str, ...] = ()  # a pipeline rank's parameters; empty: every parameter
    units: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # FSDP: flat layouts

    def positions(self, mb: int) -> range:
        """The positions of the step's global batch that micro-step `mb` reads."""
        first, count = self.batch[mb]
        return range(first, first + count)

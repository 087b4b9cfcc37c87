"""`pipeline { ... }`: stages as named contiguous layer ranges covering the model once, the
pipeline degree, a named schedule or every rank's program written out
(pipeline_programs.py), its placement and micro-batches.

The degree is the pipeline dimension of the mesh, outermost (ir/spec.py PipelineSpec), so
dp = world / degree replicas of the pipeline share the global batch (a degree that does not
divide the world is [mesh-size]). Each stage's gradients are all-reduced over its dp
replicas, one bucket a stage or in the buckets of a ddp block, each inside a stage
(stage_buckets.py), or, with an fsdp block, sharded over them in units inside each stage
(stage_units.py), over a `mesh R x S` of the dp replicas (HSDP per stage: mesh.py); the
statements the pipeline executor and graph cannot honour yet are
refused by name ([conflict]), not ignored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from schedc.ir.pipeline import Placement, Schedule, Written
from schedc.ir.source import Span
from schedc.ir.spec import PipelineSpec, StageSpec
from schedc.lang.diagnostics import Note, did_you_mean
from schedc.lang.nodes import Pipeline, PipeProgram, PipeSetting, StageDecl
from schedc.lang.resolve.batch import Terms
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.cover import prove_cover
from schedc.lang.resolve.pipeline_programs import resolve_written
from schedc.lang.resolve.refs import resolve_refs
from schedc.lang.resolve.settings import Run
from schedc.lang.resolve.stage_buckets import resolve_stage_buckets
from schedc.lang.resolve.stage_units import resolve_stage_units
from schedc.lang.resolve.values import LIMITS, int_of
from schedc.lang.syntax import (
    Name,
    Num,
    OtherSetting,
    Program,
    Recompute,
    StreamDecl,
)
from schedc.model.arch import GPTConfig

KEYS = ("stage", "degree", "schedule", "placement", "microbatches", "program")
SCHEDULES: dict[str, Schedule | Written] = {
    "gpipe": Schedule.GPIPE,
    "1f1b": Schedule.ONE_F_ONE_B,
    "interleaved": Schedule.INTERLEAVED,
    "interleaved-1f1b": Schedule.INTERLEAVED,
    "zb-h1": Schedule.ZB_H1,
    "zb-v": Schedule.ZB_V,
    "written": Written.PROGRAMS,  # the programs are written in the block
}
# what a pipeline schedule cannot take yet, and why (the graph, lowering and executor of
# DP schedules run every layer on every rank)
NOT_YET: dict[type, tuple[str, str, str]] = {  # statement -> (its keyword, what, why)
    Program: (
        "program",
        "a stream's program",
        "a pipeline rank's program is written inside the pipeline block, "
        "`program on rank 0 { F[s0]@mb0 SEND_F[s0]@mb0 ... }`",
    ),
    StreamDecl: ("stream", "a stream", "a pipeline rank runs its program in order"),
    Recompute: ("recompute", "recompute", "recompute in a pipeline stage is not built yet"),
}


def pipeline_split(
    cx: Context, model: GPTConfig | None, run: Run
) -> tuple[PipelineSpec | None, Run, Terms]:
    """The pipeline, and the run as its batch arithmetic sees it: over dp = world / degree
    ranks, its micro-batches the accumulation (`microbatches`, or `accumulate`)."""
    pipe, m = resolve_pipeline(cx, model, run.world)
    if "pipeline" not in cx.seen:
        return None, run, Terms()
    dp = None if run.world is None else run.world // (pipe.degree if pipe else run.world)
    if m is None:
        return pipe, replace(run, world=dp), Terms(ranks="dp")
    if "accumulate" in cx.seen:
        cx.err(
            "conflict",
            "accumulate and the pipeline's microbatches both count the micro-batches",
            cx.seen["pipeline.microbatches"],
            hint="keep one: a pipeline's micro-batches are its accumulation",
            notes=(Note("accumulate is given here", cx.seen["accumulate"]),),
        )
    terms = Terms("microbatches", "pipeline.microbatches", "dp")
    return pipe, replace(run, world=dp, accumulate=m), terms


def resolve_pipeline(
    cx: Context, model: GPTConfig | None, world: int | None
) -> tuple[PipelineSpec | None, int | None]:
    """The pipeline and its micro-batch count (None: not written); (None, None) without a
    pipeline block or after an error."""
    block = cx.single(Pipeline, "pipeline", "the pipeline block")
    if block is None:
        return None, None
    head = cx.src.span(block.span.start, block.span.start + len("pipeline"))
    _refuse_not_yet(cx, head)
    settings = _settings(cx, block)
    programs = [s for s in block.stmts if isinstance(s, PipeProgram)]
    schedule = _schedule(cx, settings.get("schedule"), head, programs)
    placement = _placement(cx, settings.get("placement"))
    degree = _degree(cx, settings.get("degree"), world)
    m = None
    if (mb := settings.get("microbatches")) is not None:
        m = _number(cx, mb, "microbatches", LIMITS["accumulate"])
    stages = _stages(cx, block, model, head)
    if None in (schedule, placement, degree, stages) or (mb is not None and m is None):
        return None, None
    assert schedule is not None and placement is not None and degree is not None and stages
    if not _fits(cx, schedule, placement, degree, len(stages), settings, head):
        return None, None
    written = None
    if schedule is Written.PROGRAMS:
        written = resolve_written(cx, programs, [s.name for s in stages], degree, head)
        if written is None:
            return None, None
    where = {k: s.span for k, s in settings.items()}
    units = resolve_stage_units(cx, model, stages) if model is not None else ()
    buckets = resolve_stage_buckets(cx, model, stages) if model is not None else ()
    spec = PipelineSpec(
        tuple(stages), degree, schedule, placement, head, where, units, written, buckets
    )
    return spec, m


def _refuse_not_yet(cx: Context, head: Span) -> None:
    """Each statement a pipeline schedule cannot honour yet, named ([conflict])."""
    for kind, (word, what, why) in NOT_YET.items():
        stmt: Any
        for stmt in cx.all(kind):
            span = cx.src.span(stmt.span.start, stmt.span.start + len(word))
            cx.err(
                "conflict",
                f"a pipeline schedule cannot take {what} yet",
                span,
                hint=why,
                notes=(Note("the pipeline is declared here", head),),
            )


def _settings(cx: Context, block: Pipeline) -> dict[str, PipeSetting]:
    """Each setting given once; a key the block lacks is [unknown-setting]."""
    out: dict[str, PipeSetting] = {}
    for s in block.stmts:
        if isinstance(s, OtherSetting):
            hint = did_you_mean(s.key.text, KEYS) or f"pipeline takes {', '.join(KEYS)}"
            cx.err("unknown-setting", f"a pipeline block has no '{s.key.text}'", s.key.span, hint)
        elif isinstance(s, PipeSetting) and cx.once(f"pipeline.{s.key}", s.span, f"'{s.key}'"):
            out[s.key] = s
    return out


def _schedule(
    cx: Context, s: PipeSetting | None, head: Span, programs: list[PipeProgram]
) -> Schedule | Written | None:
    """The named schedule, or Written.PROGRAMS where the block writes the programs (with no
    `schedule`, or `schedule written`)."""
    if s is None:
        if programs:
            return Written.PROGRAMS
        cx.err(
            "missing-setting",
            "the pipeline block names no schedule",
            head,
            hint="add `schedule 1f1b` (or gpipe, interleaved, zb-h1, zb-v), or write every rank's "
            "program: `program on rank 0 { F[s0]@mb0 ... }`",
        )
        return None
    assert isinstance(s.value, Name)
    if s.value.text not in SCHEDULES:
        hint = did_you_mean(s.value.text, SCHEDULES) or f"schedules: {', '.join(SCHEDULES)}"
        cx.err("unknown-name", f"unknown pipeline schedule '{s.value.text}'", s.value.span, hint)
        return None
    schedule = SCHEDULES[s.value.text]
    if schedule is Written.PROGRAMS and not programs:
        cx.err(
            "missing-setting",
            "`schedule written`, but the pipeline block writes no program",
            s.span,
            hint="write every rank's program in the block: `program on rank 0 { F[s0]@mb0 ... }`",
        )
        return None
    if schedule is not Written.PROGRAMS and programs:
        p = programs[0]
        cx.err(
            "conflict",
            f"the pipeline runs the named schedule '{s.value.text}' and written programs",
            cx.src.span(p.span.start, p.span.start + len("program")),
            hint=f"keep one: drop `schedule {s.value.text}` to run the programs as written, "
            "or drop the programs",
            notes=(Note("the schedule is named here", s.span),),
        )
        return None
    return schedule


def _placement(cx: Context, s: PipeSetting | None) -> Placement | None:
    if s is None:
        return Placement.LOOP
    assert isinstance(s.value, Name)
    names = [p.value for p in Placement]
    if s.value.text not in names:
        hint = did_you_mean(s.value.text, names) or "placements: loop, v"
        cx.err("unknown-name", f"unknown placement '{s.value.text}'", s.value.span, hint)
        return None
    return Placement(s.value.text)


def _number(cx: Context, s: PipeSetting, what: str, limits: tuple[int, int]) -> int | None:
    assert isinstance(s.value, Num)
    return int_of(cx.diag, s.value, what, *limits)


def _degree(cx: Context, s: PipeSetting | None, world: int | None) -> int | None:
    """The pipeline ranks (the world when not written); it must divide the world, whose
    quotient is dp, the pipeline's replicas ([mesh-size])."""
    if s is None or world is None:
        return world
    degree = _number(cx, s, "degree", LIMITS["world"])
    if degree is not None and world % degree:
        fits = [str(d) for d in range(1, world + 1) if world % d == 0][:6]
        cx.err(
            "mesh-size",
            f"degree {degree} does not divide world {world}: the ranks are degree x dp, "
            "whole pipelines",
            s.span,
            hint=f"for world {world}, degree {', '.join(fits)}",
            notes=tuple(Note("the world is given here", w) for w in [cx.seen.get("world")] if w),
        )
        return None
    return degree


def _stages(
    cx: Context, block: Pipeline, model: GPTConfig | None, head: Span
) -> list[StageSpec] | None:
    """The stages, covering every layer once (through cover.py, as buckets and units do),
    each a contiguous run of layers, in model order."""
    decls = [s for s in block.stmts if isinstance(s, StageDecl)]
    if not decls:
        cx.err(
            "missing-setting",
            "the pipeline block has no stages",
            head,
            hint="add stages, e.g. `stage s0 = embed, h.0 .. h.1` and "
            "`stage s1 = h.2 .. h.3, head`",
        )
        return None
    if model is None:
        return None
    names: dict[str, Span] = {}
    groups = []
    errors = len(cx.diag.errors)
    for d in decls:
        if d.name.text in names:
            cx.err(
                "duplicate",
                f"stage '{d.name.text}' is defined twice",
                d.name.span,
                hint="give each stage its own name",
                notes=(Note("first defined here", names[d.name.text]),),
            )
            continue
        names[d.name.text] = d.name.span
        groups.append((d.name.text, d.span, resolve_refs(cx, d.refs, model, params=False)))
    if len(cx.diag.errors) > errors:
        return None
    prove_cover(cx, groups, model, head, "stage")
    if len(cx.diag.errors) > errors:
        return None
    return _in_order(cx, groups, model)


def _in_order(cx: Context, groups: list, model: GPTConfig) -> list[StageSpec] | None:
    """Stages as layer runs: each contiguous, each starting where the one before ends."""
    owner = {p.name: layer for layer in model.layers for p in model.layer_params(layer)}
    out, ok, nxt = [], True, 0
    for name, span, items in groups:
        idx = sorted({model.layer_index(owner[p]) for p, _ in items})
        layers = tuple(model.layers[i] for i in idx)
        if idx != list(range(idx[0], idx[-1] + 1)):
            gap = next(model.layers[i + 1] for i in idx if i + 1 not in idx)
            hint = "a stage is a contiguous range of layers, e.g. h.2 .. h.5"
            msg = f"stage '{name}' is not one run of layers: it skips {gap}"
            cx.err("stage-order", msg, span, hint=hint)
            ok = False
        elif ok and idx[0] != nxt:
            before = (
                "the first stage holds embed"
                if nxt == 0
                else f"the stage before it ends at {model.layers[nxt - 1]}"
            )
            cx.err(
                "stage-order",
                f"stage '{name}' begins at {layers[0]}, but {before}",
                span,
                hint="list the stages in model order: the first holds embed, the last head",
            )
            ok = False
        nxt = idx[-1] + 1
        out.append(StageSpec(name, layers, span))
    return out if ok else None


def _fits(
    cx: Context,
    schedule: Schedule | Written,
    placement: Placement,
    degree: int,
    n: int,
    settings: dict[str, PipeSetting],
    head: Span,
) -> bool:
    """The stage count the schedule places on `degree` ranks: one a rank, v >= 2 a rank
    (interleaved) or two a rank (zb-v); and its placement: a V for zb-v, which needs it, a
    loop for the others where a rank holds more than one. Written programs take any whole
    number of stages a rank, in either placement."""
    if schedule is Written.PROGRAMS:
        if n % degree == 0:
            return True
        cx.err(
            "stage-count",
            f"{n} stages do not divide over the pipeline's {degree} ranks",
            settings["degree"].span if "degree" in settings else head,
            hint=f"declare {degree} or {2 * degree} stages: every rank holds as many",
            notes=(Note("the stages are in this block", head),),
        )
        return False
    at = settings["schedule"].span
    if schedule is Schedule.INTERLEAVED and (n % degree or n < 2 * degree):
        wrong = (
            f"interleaved runs v >= 2 stages on each of its {degree} ranks; {n} stages are not that"
        )
        hint = f"declare {2 * degree} or {3 * degree} stages, or use 1f1b"
    elif schedule is Schedule.ZB_V and n != 2 * degree:
        wrong = f"zb-v runs 2 stages on each of its {degree} ranks, in a V; {n} stages are not that"
        hint = f"declare {2 * degree} stages, or use zb-h1 for one stage a rank"
    elif schedule not in (Schedule.INTERLEAVED, Schedule.ZB_V) and n != degree:
        wrong = f"{schedule.value} runs one stage a rank: {n} stages on {degree} ranks"
        hint = f"declare {degree} stages, or use interleaved for v stages a rank"
    else:
        return _placed(cx, schedule, placement, degree, n, settings)
    notes = (Note("the stages are in this block", head),)
    cx.err("stage-count", wrong, at, hint=hint, notes=notes)
    return False


def _placed(
    cx: Context,
    schedule: Schedule,
    placement: Placement,
    degree: int,
    n: int,
    settings: dict[str, PipeSetting],
) -> bool:
    """zb-v's stages in a V, the other named schedules' in a loop ([conflict]; with one stage
    a rank the two placements are the same)."""
    if placement is schedule.placement or n == degree:
        return True
    if schedule is Schedule.ZB_V:
        given = settings.get("placement")
        cx.err(
            "conflict",
            "zb-v places its stages in a V (rank r holds stages r and "
            f"{2 * degree - 1} - r), not in a {placement.value}"
            + ("" if given else " (the default placement)"),
            given.span if given else settings["schedule"].span,
            hint="write `placement v` in the pipeline block",
        )
        return False
    cx.err(
        "conflict",
        f"{schedule.value} places its stages in a loop; of the named schedules only zb-v "
        "runs a V (Megatron's interleaved order with v waits on itself in its warm-up)",
        settings["placement"].span,
        hint="write `placement loop`, or `schedule zb-v` for 2 stages a rank in a V",
    )
    return False

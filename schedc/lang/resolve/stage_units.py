"""`fsdp { ... }` in a pipeline file: FSDP per stage, each stage's parameters sharded over
its dp replicas (exec/pipeline.py runs it).

    fsdp { }                                    one unit a stage (the tied wte one of its own)
    fsdp { unit tied = wte.weight  unit a = wpe.weight, h.0  unit b = h.1 .. h.3, head }

Units given must cover every parameter once (cover.py, as in a DP schedule) and each lie
inside one stage ([conflict] naming the stages it spans); the tied wte.weight is a unit of
its own, since the head's stage keeps a copy of it sharded in the same layout. Under a
pipeline a unit is gathered once a step, before its stage's first forward, and kept until
its last backward (torchtitan sets reshard_after_forward=False under PP), then its gradient
is reduce-scattered: so `prefetch`, `reshard_after_forward on`, `no_sync` and `recompute`
have nothing to say here and are refused by name, not ignored (`reshard_after_forward off`
says what runs, and is taken).
"""

from __future__ import annotations

from schedc.ir.source import Span
from schedc.ir.spec import TIED, StageSpec, StageUnit, stage_units
from schedc.lang.diagnostics import Note
from schedc.lang.resolve.blocks import Block, read_block
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.cover import resolve_members
from schedc.lang.syntax import FSDP, Prefetch, Recompute, Toggle, UnitDecl
from schedc.model.arch import GPTConfig

WHY = "a pipeline shards each stage's parameters over its own replicas"
PER_STAGE = (
    "a pipeline stage's units are gathered once a step, before its first forward, and kept "
    "until its last backward (reshard_after_forward off, as torchtitan under PP)"
)


def resolve_stage_units(
    cx: Context, model: GPTConfig, stages: list[StageSpec]
) -> tuple[StageUnit, ...]:
    """The fsdp block's units, each inside one stage; one a stage when it names none; ()
    without an fsdp block (each stage's gradients then all-reduced in one bucket)."""
    ast = cx.single(FSDP, "fsdp", "the fsdp block")
    if ast is None:
        return ()
    block = read_block(cx, ast, "fsdp")
    _refuse_dp_settings(cx, block.stmts)
    decls = [s for s in block.stmts if isinstance(s, UnitDecl)]
    if not decls:
        split = tuple(s.layers for s in stages)
        return tuple(
            StageUnit(_default_name(stages[s].name, params), s, params, stages[s].span)
            for s, params in stage_units(model, split)
        )
    errors = len(cx.diag.errors)
    units = []
    for name, span, params, stage in in_stages(cx, block, decls, model, stages, "unit", WHY):
        if TIED in params and len(params) > 1:
            cx.err(
                "conflict",
                f"unit '{name}' holds {TIED} with other parameters; in a pipeline the tied "
                "weight is a unit of its own",
                span,
                hint=f"`unit tied = {TIED}`: the head's stage keeps a copy of it, sharded the "
                "same way, so the two copies' shards match",
            )
        else:
            units.append(StageUnit(name, stage, params, span))
    return tuple(units) if len(cx.diag.errors) == errors else ()


def in_stages(
    cx: Context,
    block: Block,
    decls: list,
    model: GPTConfig,
    stages: list[StageSpec],
    what: str,
    why: str,
) -> list[tuple[str, Span, tuple[str, ...], int]]:
    """A pipeline's buckets or units, covering every parameter once (cover.py), each as
    (name, span, parameters in the model's order, its stage); one across stages is a
    [conflict] naming them, and left out. [] after a coverage error."""
    errors = len(cx.diag.errors)
    _, groups = resolve_members(cx, block, decls, model, what, "")
    if len(cx.diag.errors) > errors:
        return []
    stage_of = {layer: i for i, st in enumerate(stages) for layer in st.layers}
    out = []
    for name, span, items in groups:
        names = {p for p, _ in items}
        params = tuple(p.name for p in model.params if p.name in names)
        spans = sorted({stage_of[model.param(p).layer] for p in params})
        if len(spans) > 1:
            listed = " and ".join(f"'{stages[s].name}'" for s in spans)
            cx.err(
                "conflict",
                f"{what} '{name}' spans stages {listed}: {why}",
                span,
                hint=f"split the {what} where the stages meet",
                notes=tuple(Note(f"stage '{stages[s].name}'", stages[s].span) for s in spans),
            )
        else:
            out.append((name, span, params, spans[0]))
    return out


def _default_name(stage: str, params: tuple[str, ...]) -> str:
    return "tied" if params == (TIED,) else stage


def _refuse_dp_settings(cx: Context, stmts) -> None:
    """What an fsdp block says about gathering and freeing within a step: not for a stage."""
    for s in stmts:
        if isinstance(s, Prefetch):
            word = "prefetch"
        elif isinstance(s, Toggle) and s.key == "no_sync":
            word = s.key
        elif isinstance(s, Toggle) and s.key == "reshard_after_forward" and s.value.on:
            word = "reshard_after_forward on"  # off says what a stage does
        elif isinstance(s, Recompute):
            word = "recompute"
        else:
            continue
        cx.err(
            "conflict",
            f"a pipeline's fsdp block cannot take {word}",
            cx.src.span(s.span.start, s.span.start + len(word)),
            hint=PER_STAGE,
        )

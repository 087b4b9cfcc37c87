"""`ddp { ... }` in a pipeline file: DDP per stage, each stage's gradients all-reduced over
its dp replicas in the buckets written (exec/pipeline_sync.py ReplicatedStages runs them).

    ddp { }                                      one bucket a stage (as without the block)
    ddp { bucket b1 = head, h.3  bucket b2 = h.2 .. h.0, embed }

Buckets given must cover every parameter once (cover.py, as in a DP schedule) and each lie
inside one stage ([conflict] naming the stages it spans). wte.weight goes in the embed's
stage's bucket; the head's stage's copy of it is reduced with that stage's bucket holding
the head, and the two copies are summed over their pair of ranks after the dp reduction.
Under a pipeline a stage's buckets are all launched after its last B or W, in reverse layer
order, and waited for before the update: so `bucket_cap` (buckets made while backward
runs), `overlap off` and `no_sync off` have nothing to say here and are refused by name,
not ignored (`overlap on` and `no_sync on` say what runs, and are taken).
"""

from __future__ import annotations

from schedc.ir.spec import StageBucket, StageSpec
from schedc.lang.diagnostics import Note
from schedc.lang.resolve.blocks import read_block
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.stage_units import in_stages
from schedc.lang.syntax import DDP, FSDP, BucketCap, BucketDecl, Toggle
from schedc.model.arch import GPTConfig

WHY = "a pipeline all-reduces each stage's gradients over its own replicas"
PER_STAGE = (
    "a pipeline stage's buckets are all-reduced once a step, after its last backward, while "
    "the rank runs on (overlap on, no_sync on)"
)


def resolve_stage_buckets(
    cx: Context, model: GPTConfig, stages: list[StageSpec]
) -> tuple[StageBucket, ...]:
    """The ddp block's buckets, each inside one stage; one a stage when it names none; ()
    without a ddp block (each stage's gradients then all-reduced in one bucket)."""
    ddps, fsdps = cx.all(DDP), cx.all(FSDP)
    if ddps and fsdps:
        cx.err(
            "conflict",
            "a pipeline is either DDP or FSDP per stage, not both",
            fsdps[0].span,
            hint="keep one of the ddp and fsdp blocks",
            notes=(Note("the ddp block is here", ddps[0].span),),
        )
        return ()
    ast = cx.single(DDP, "ddp", "the ddp block")
    if ast is None:
        return ()
    block = read_block(cx, ast, "ddp")
    _refuse_dp_settings(cx, block.stmts)
    decls = [s for s in block.stmts if isinstance(s, BucketDecl)]
    if not decls:
        return tuple(
            StageBucket(
                st.name,
                s,
                tuple(p.name for layer in st.layers for p in model.layer_params(layer)),
                st.span,
            )
            for s, st in enumerate(stages)
        )
    errors = len(cx.diag.errors)
    buckets = tuple(
        StageBucket(name, stage, params, span)
        for name, span, params, stage in in_stages(cx, block, decls, model, stages, "bucket", WHY)
    )
    return buckets if len(cx.diag.errors) == errors else ()


def _refuse_dp_settings(cx: Context, stmts) -> None:
    """What a ddp block says about launching buckets within backward: not for a stage."""
    for s in stmts:
        if isinstance(s, BucketCap):
            word = "bucket_cap"
        elif isinstance(s, Toggle) and not s.value.on:
            word = f"{s.key} off"  # on says what a stage does
        else:
            continue
        cx.err(
            "conflict",
            f"a pipeline's ddp block cannot take {word}",
            cx.src.span(s.span.start, s.span.start + len(s.key if isinstance(s, Toggle) else word)),
            hint=PER_STAGE,
        )

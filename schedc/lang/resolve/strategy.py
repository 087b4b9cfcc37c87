"""The strategy: a ddp block, an fsdp block, or neither (one process); never both, and a
world of more than one rank needs one of them."""

from __future__ import annotations

from schedc.ir.spec import DDPSpec, FSDPSpec
from schedc.lang.diagnostics import Note
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.ddp import resolve_ddp
from schedc.lang.resolve.fsdp import resolve_fsdp
from schedc.lang.syntax import DDP, FSDP
from schedc.model.arch import GPTConfig


def resolve_strategy(
    cx: Context, model: GPTConfig | None, world: int | None
) -> DDPSpec | FSDPSpec | None:
    """The block's buckets or units (resolved only against a known model)."""
    ddps, fsdps = cx.all(DDP), cx.all(FSDP)
    strategy: DDPSpec | FSDPSpec | None = None
    if ddps and fsdps:
        cx.err(
            "conflict",
            "a schedule is either DDP or FSDP, not both",
            fsdps[0].span,
            hint="keep one of the ddp and fsdp blocks",
            notes=(Note("the ddp block is here", ddps[0].span),),
        )
    elif model is not None:
        if ddps:
            cx.single(DDP, "ddp", "the ddp block")  # a second block is a [duplicate]
            strategy = resolve_ddp(cx, ddps[0], model)
        elif fsdps:
            cx.single(FSDP, "fsdp", "the fsdp block")
            strategy = resolve_fsdp(cx, fsdps[0], model)
    if world is not None and world > 1 and not ddps and not fsdps:
        cx.err(
            "missing-setting",
            f"world {world} needs a ddp or fsdp block to say how gradients are combined",
            cx.seen["world"],
            hint="add `ddp { bucket_cap 25 MiB }`, for one",
        )
    return strategy

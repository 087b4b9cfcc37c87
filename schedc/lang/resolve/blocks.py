"""The statements of a ddp or fsdp block: those it takes, and its on/off settings.

The grammar parses the statements of both blocks, and a statement beginning with any name,
in either; here each statement the block does not take is an [unknown-setting] that names
what it does take (and the other block, where the statement is that one's).
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.source import Span
from schedc.lang.diagnostics import did_you_mean
from schedc.lang.resolve.context import Context
from schedc.lang.syntax import (
    DDP,
    FSDP,
    BlockStmt,
    BucketCap,
    BucketDecl,
    OtherSetting,
    Prefetch,
    Recompute,
    Toggle,
    UnitDecl,
)

# the statements each block takes, as the grammar spells their keywords
BLOCK_KEYS = {
    "ddp": ("bucket", "bucket_cap", "overlap", "no_sync"),
    "fsdp": ("unit", "prefetch", "reshard_after_forward", "no_sync", "recompute"),
}
# words inside a block's statements, which a misspelling may be nearest to
BLOCK_WORDS = {
    "ddp": {"first": "it follows bucket_cap: `bucket_cap 25 MiB first 1 MiB`"},
    "fsdp": {"keep": "it ends a unit: `unit tied = wte.weight keep`"},
}
BLOCK_ARTICLE = {"ddp": "a ddp", "fsdp": "an fsdp"}  # as said aloud: "an eff-ess-dee-pee"
KEYWORDS = {
    BucketDecl: "bucket",
    BucketCap: "bucket_cap",
    UnitDecl: "unit",
    Prefetch: "prefetch",
    Recompute: "recompute",
}


@dataclass(frozen=True)
class Block:
    """A ddp or fsdp block read for its strategy."""

    kind: str  # "ddp" or "fsdp"
    stmts: list[BlockStmt]  # the statements it takes, in the order written
    toggles: dict[str, bool]  # its on/off settings, each given once
    head: Span  # its keyword: where a finding about the whole block points
    clean: bool  # it takes every statement in it (else a misspelling was reported)


def read_block(cx: Context, block: DDP | FSDP, kind: str) -> Block:
    """The block's statements that it takes, and its toggles."""
    stmts = _taken(cx, block.stmts, kind)
    toggles = {}
    for t in stmts:
        if isinstance(t, Toggle) and cx.once(f"{kind}.{t.key}", t.span, f"'{t.key}'"):
            toggles[t.key] = t.value.on
    head = cx.src.span(block.span.start, block.span.start + len(kind))
    return Block(kind, stmts, toggles, head, len(stmts) == len(block.stmts))


def _taken(cx: Context, stmts: tuple[BlockStmt, ...], kind: str) -> list[BlockStmt]:
    """The statements a block takes; each other one is an [unknown-setting] naming what the
    block takes."""
    takes = BLOCK_KEYS[kind]
    kept = []
    for s in stmts:
        key = _keyword(s)
        if key in takes:
            kept.append(s)
            continue
        owner = next((b for b, keys in BLOCK_KEYS.items() if key in keys), None)
        listed = f"{kind} takes {', '.join(takes)}"
        if owner is not None:
            hint = f"`{key}` is {BLOCK_ARTICLE[owner]} setting; {listed}"
        else:  # a word that ends a line (`kep`) reads as a statement of its own
            words = BLOCK_WORDS[kind].items()
            hint = did_you_mean(key, takes) or next(
                (f"did you mean '{w}'? ({ex})" for w, ex in words if did_you_mean(key, [w])),
                listed,
            )
        span = (
            s.key.span
            if isinstance(s, OtherSetting)
            else cx.src.span(s.span.start, s.span.start + len(key))
        )
        cx.err("unknown-setting", f"{BLOCK_ARTICLE[kind]} block has no '{key}'", span, hint)
        cx.refs_ok = False  # a misspelled bucket or unit: coverage would repeat it
    return kept


def _keyword(stmt: BlockStmt) -> str:
    """The keyword a ddp or fsdp block statement begins with."""
    if isinstance(stmt, Toggle):
        return stmt.key
    if isinstance(stmt, OtherSetting):
        return stmt.key.text
    return KEYWORDS[type(stmt)]

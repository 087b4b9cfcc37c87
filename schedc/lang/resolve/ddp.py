"""DDP: buckets of gradients, all-reduced in the order listed while backward runs. Written
out (`bucket b1 = head, h.3 .. h.0`) or made by `bucket_cap 25 MiB [first 1 MiB]`."""

from __future__ import annotations

from schedc.ir.spec import TIED, BucketSpec, DDPSpec, MiB
from schedc.lang.params import auto_buckets, ready_position
from schedc.lang.resolve.blocks import read_block
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.cover import resolve_members
from schedc.lang.resolve.values import size_of
from schedc.lang.syntax import DDP, BucketCap, BucketDecl
from schedc.model.arch import GPTConfig


def resolve_ddp(cx: Context, ast: DDP, cfg: GPTConfig) -> DDPSpec:
    """The buckets, covering every parameter once, each holding its parameters in the order
    their gradients complete."""
    block = read_block(cx, ast, "ddp")
    buckets = [s for s in block.stmts if isinstance(s, BucketDecl)]
    caps = [s for s in block.stmts if isinstance(s, BucketCap)]
    overlap, no_sync = block.toggles.get("overlap", True), block.toggles.get("no_sync", True)
    for c in caps:
        cx.once("bucket_cap", c.span, "bucket_cap")
    if buckets and caps:
        cx.err(
            "conflict",
            "give buckets or a bucket_cap, not both",
            caps[0].span,
            hint="bucket_cap makes the buckets by itself; drop it or the buckets",
        )
    elif caps:
        return _capped(cx, caps[0], cfg, overlap, no_sync)
    _, groups = resolve_members(
        cx,
        block,
        buckets,
        cfg,
        "bucket",
        "add `bucket b1 = head, h.3 .. h.0, embed` or `bucket_cap 25 MiB`",
    )
    ready = ready_position(cfg)
    specs = []
    for gname, gspan, items in groups:
        params = sorted({p for p, _ in items}, key=lambda p: ready[p])
        specs.append(
            BucketSpec(gname, tuple(params), gspan, sum(cfg.param(p).nbytes() for p in params))
        )
    _bucket_order(cx, specs, ready)
    return DDPSpec(tuple(specs), overlap, no_sync)


def _capped(cx: Context, c: BucketCap, cfg: GPTConfig, overlap: bool, no_sync: bool) -> DDPSpec:
    """The buckets `bucket_cap` makes; the first is capped at `first` (by default the cap
    or 1 MiB, whichever is smaller), so a reduction starts early in backward."""
    cap = size_of(cx.diag, c.size, "bucket_cap")
    first = size_of(cx.diag, c.first, "first bucket") if c.first else min(cap or MiB, MiB)
    if cap is None or first is None:
        return DDPSpec((), overlap, no_sync)
    return DDPSpec(tuple(auto_buckets(cfg, cap, first)), overlap, no_sync, cap, first)


def _bucket_order(cx: Context, buckets: list[BucketSpec], ready: dict[str, int]) -> None:
    """Warn when a bucket listed earlier completes later than one listed after it: buckets
    launch in the order listed, so it holds back each one after it."""
    done = [max((ready[p] for p in b.params), default=0) for b in buckets]
    for i, b in enumerate(buckets):
        later = [j for j in range(i + 1, len(buckets)) if done[j] < done[i]]
        if not later or not b.params:
            continue
        last_param = max(b.params, key=lambda p: ready[p])
        if TIED in b.params and last_param == TIED:
            cx.diag.warning(
                "tied-late",
                f"bucket '{b.name}' holds {TIED}, whose gradient is complete only after "
                "bwd[embed] (the embedding and lm_head share it)",
                b.span,
                hint=f"move {TIED} to the last bucket, so '{b.name}' can launch earlier",
            )
        else:
            cx.diag.warning(
                "bucket-order",
                f"bucket '{b.name}' is complete after '{buckets[later[0]].name}' but is "
                "listed first, so both launch late",
                b.span,
                hint="list buckets in reverse layer order: the first bucket holds the last layers",
            )

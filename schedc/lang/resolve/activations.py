"""What a step keeps of its activations: layers that recompute their forward before their
backward (`recompute h.0 .. h.3` at top level, `recompute u1` inside fsdp), and the head's
loss made a chunk of tokens at a time (`loss chunk 1024`)."""

from __future__ import annotations

from dataclasses import replace

from schedc.ir.spec import DDPSpec, FSDPSpec, Numerics
from schedc.lang.diagnostics import did_you_mean
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.refs import layer_name
from schedc.lang.resolve.values import CHUNK, int_of
from schedc.lang.syntax import FSDP, LossChunk, Recompute
from schedc.model.arch import GPTConfig


def chunk_loss(cx: Context, numerics: Numerics) -> Numerics:
    """The numerics with `loss chunk N`; not part of a precision policy: --precision keeps it."""
    lc = cx.single(LossChunk, "loss", "`loss chunk`")
    if lc is None:
        return numerics
    return replace(numerics, loss_chunk=int_of(cx.diag, lc.tokens, "loss chunk", *CHUNK))


def resolve_recompute(
    cx: Context, cfg: GPTConfig | None, strategy: DDPSpec | FSDPSpec | None
) -> frozenset[str]:
    """The layers that recompute: named as layers and ranges at top level, as units
    inside the fsdp block (every layer that reads the unit's parameters)."""
    top = cx.single(Recompute, "recompute", "`recompute`")
    fsdps = cx.all(FSDP)
    said = [s for s in fsdps[0].stmts if isinstance(s, Recompute)] if fsdps else []
    for s in said:  # once, like every setting of a block: each repeat is reported
        cx.once("fsdp.recompute", s.span, "`recompute` in the fsdp block")
    in_fsdp = said[0] if said else None
    if cfg is None:
        return frozenset()
    out: set[str] = set()
    if top is not None:
        for ref in top.refs:
            names = [n for n in (ref.first, ref.last) if n is not None]
            named = [layer_name(cx, n, cfg) for n in names]
            found = [x for x in named if x is not None]
            if len(found) < len(named):
                continue
            idx = sorted(cfg.layer_index(x) for x in found)  # a range in either direction
            out.update(cfg.layers[idx[0] : idx[-1] + 1])
    if in_fsdp is not None and isinstance(strategy, FSDPSpec):
        out.update(_unit_layers(cx, in_fsdp, strategy))
    return frozenset(out)


def _unit_layers(cx: Context, stmt: Recompute, strategy: FSDPSpec) -> list[str]:
    """The layers of the units `recompute u1, u3` names, one by one."""
    units = {u.name: u for u in strategy.units}
    out: list[str] = []
    for ref in stmt.refs:
        if ref.last is not None:
            cx.err(
                "syntax",
                "inside fsdp, recompute names units one by one, not a range",
                ref.span,
                hint=f"write `recompute {ref.first.text}, {ref.last.text}`, or name "
                "layers with a top-level `recompute h.0 .. h.3`",
            )
        elif ref.first.text not in units:
            cx.err(
                "unknown-name",
                f"unknown unit '{ref.first.text}'",
                ref.first.span,
                hint=did_you_mean(ref.first.text, units) or f"units: {', '.join(units)}",
            )
        else:
            out += units[ref.first.text].layers
    return out

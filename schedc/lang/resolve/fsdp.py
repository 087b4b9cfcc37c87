"""FSDP: units of parameters, each gathered before the layers that read it and freed after,
its gradients reduce-scattered; `prefetch` depths, `reshard_after_forward`, `no_sync`."""

from __future__ import annotations

from schedc.ir.source import Span
from schedc.ir.spec import TIED, FSDPSpec, UnitSpec
from schedc.lang.resolve.blocks import read_block
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.cover import resolve_members
from schedc.lang.resolve.values import int_of
from schedc.lang.syntax import FSDP, BlockStmt, Prefetch, UnitDecl
from schedc.model.arch import GPTConfig


def resolve_fsdp(cx: Context, ast: FSDP, cfg: GPTConfig) -> FSDPSpec:
    """The units, covering every parameter once, in the order forward first reads them
    (a kept unit before the others of its first layer)."""
    block = read_block(cx, ast, "fsdp")
    units = [s for s in block.stmts if isinstance(s, UnitDecl)]
    depth = _prefetch(cx, block.stmts)
    units, groups = resolve_members(
        cx,
        block,
        units,
        cfg,
        "unit",
        "add units, e.g. `unit tied = wte.weight keep` and `unit u1 = embed .. h.1`",
    )
    order = {layer: i for i, layer in enumerate(cfg.layers)}
    specs = []
    for (gname, gspan, items), u in zip(groups, units):
        params = tuple(p.name for p in cfg.params if p.name in {q for q, _ in items})
        layers = sorted({layer for p in params for layer in cfg.users(p)}, key=order.__getitem__)
        _contiguous(cx, gname, gspan, params, layers, u.keep, order)
        nbytes = sum(cfg.param(p).nbytes() for p in params)
        specs.append(UnitSpec(gname, params, tuple(layers), u.keep, gspan, nbytes))
    specs.sort(key=lambda s: (order[s.layers[0]] if s.layers else 0, not s.keep))
    return FSDPSpec(
        tuple(specs),
        depth["forward"],
        depth["backward"],
        block.toggles.get("reshard_after_forward", True),
        block.toggles.get("no_sync", False),
    )


def _prefetch(cx: Context, stmts: list[BlockStmt]) -> dict[str, int]:
    """How many units ahead each pass gathers (`prefetch forward 2`); 1 when not given."""
    depth = {"forward": 1, "backward": 1}
    for p in (s for s in stmts if isinstance(s, Prefetch)):
        if cx.once(f"prefetch.{p.direction}", p.span, f"prefetch {p.direction}"):
            v = int_of(cx.diag, p.depth, f"prefetch {p.direction}", 0, 64)
            if v is not None:
                depth[p.direction] = v
    return depth


def _contiguous(
    cx: Context,
    name: str,
    span: Span,
    params: tuple[str, ...],
    layers: list[str],
    keep: bool,
    order: dict[str, int],
) -> None:
    """A unit that is freed between uses is read by adjacent layers only: else it would
    stay gathered from its first reader to its last."""
    idx = [order[x] for x in layers]
    if not layers or keep or idx == list(range(idx[0], idx[-1] + 1)):
        return
    if TIED in params:
        cx.err(
            "tied-param",
            f"unit '{name}' holds {TIED}, which embed and head both read, so it "
            f"would stay gathered from {layers[0]} to {layers[-1]}",
            span,
            hint=f"give the tied weight a unit of its own that stays gathered: "
            f"`unit tied = {TIED} keep`",
        )
    else:
        cx.err(
            "unit-contiguous",
            f"unit '{name}' is read by layers {', '.join(layers)}, which are not adjacent",
            span,
            hint="make each unit a contiguous range of layers, or mark it `keep`",
        )

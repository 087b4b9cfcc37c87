"""Buckets and units as groups of parameters: each group's own name, its references
resolved, and coverage proven (every parameter in exactly one group)."""

from __future__ import annotations

from schedc.ir.source import Span
from schedc.lang.diagnostics import Note
from schedc.lang.params import group_by_layer
from schedc.lang.resolve.blocks import Block
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.refs import resolve_refs
from schedc.lang.syntax import BucketDecl, UnitDecl
from schedc.model.arch import GPTConfig

Group = tuple[str, Span, list[tuple[str, Span]]]  # name, declaration, (parameter, its ref)


def resolve_members(
    cx: Context,
    block: Block,
    decls: list[BucketDecl] | list[UnitDecl],
    cfg: GPTConfig,
    what: str,
    example: str,
) -> tuple[list, list[Group]]:
    """A block's buckets or units: at least one, each named once, together holding every
    parameter exactly once (not proven where a mistake already said would only repeat)."""
    if not decls and block.clean:  # else a misspelling said it
        cx.err("missing-setting", f"the {block.kind} block has no {what}s", block.head, example)
    kept, groups = _groups(cx, decls, cfg, what)
    if decls and cx.refs_ok:
        prove_cover(cx, groups, cfg, block.head, what)
    return kept, groups


def _groups(
    cx: Context, decls: list[BucketDecl] | list[UnitDecl], cfg: GPTConfig, what: str
) -> tuple[list, list[Group]]:
    """Buckets or units with their own names, and each as (name, span, resolved refs);
    a name defined twice is an error."""
    names: dict[str, Span] = {}
    kept, groups = [], []
    for d in decls:
        if d.name.text in names:
            cx.err(
                "duplicate",
                f"{what} '{d.name.text}' is defined twice",
                d.name.span,
                hint=f"give each {what} its own name",
                notes=(Note("first defined here", names[d.name.text]),),
            )
            cx.refs_ok = False  # its layers would be reported uncovered: the same mistake
            continue
        names[d.name.text] = d.name.span
        kept.append(d)
        groups.append((d.name.text, d.span, resolve_refs(cx, d.refs, cfg, params=True)))
    return kept, groups


def prove_cover(
    cx: Context, groups: list[Group], cfg: GPTConfig, block_span: Span, what: str
) -> dict[str, str]:
    """Prove every parameter is in exactly one group; returns param -> group."""
    owner: dict[str, tuple[str, Span]] = {}
    # one finding per ref and group it repeats, noting where the first repeat was given
    repeats: dict[tuple[Span, str, str], tuple[Span, list[str]]] = {}
    for gname, _gspan, items in groups:
        for param, span in items:
            if param in owner:
                other, ospan = owner[param]
                repeats.setdefault((span, gname, other), (ospan, []))[1].append(param)
                continue
            owner[param] = (gname, span)
    for (span, gname, other), (ospan, params) in repeats.items():
        names = group_by_layer(params, cfg)
        where = "twice in" if other == gname else f"in both {what} '{other}' and"
        cx.err(
            "double-cover",
            f"{_listed(names)} {'is' if len(names) == 1 else 'are'} {where} {what} '{gname}'",
            span,
            hint=f"a parameter belongs to exactly one {what}",
            notes=(Note(f"already in '{other}' here", ospan),),
        )
    missing = [p for p in cfg.params if p.name not in owner]
    if missing:
        names = group_by_layer([p.name for p in missing], cfg)
        cx.err(
            "uncovered",
            f"{_listed(names)} {'is' if len(names) == 1 else 'are'} in no {what}",
            block_span,
            hint=f"every parameter must be in exactly one {what}: add {names[0]} to one",
        )
    return {p: g for p, (g, _) in owner.items()}


def _listed(names: list[str]) -> str:
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")

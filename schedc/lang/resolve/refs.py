"""References to layers and parameters: `h.3`, `embed`, `wte.weight`, a range `h.0 .. h.5`
(in either direction), each resolved against the model or reported with what it has."""

from __future__ import annotations

from schedc.ir.source import Span
from schedc.lang.diagnostics import did_you_mean
from schedc.lang.resolve.context import Context
from schedc.lang.syntax import Name, Ref
from schedc.model.arch import GPTConfig


def resolve_refs(
    cx: Context, refs: tuple[Ref, ...], cfg: GPTConfig, *, params: bool
) -> list[tuple[str, Span]]:
    """Resolve refs to (parameter, span of the ref) in model order within each ref."""
    errors_before = len(cx.diag.errors)
    out: list[tuple[str, Span]] = []
    for ref in refs:
        if ref.last is None:
            layers = _layer_or_param(cx, ref.first, cfg, params=params)
            if layers is not None:
                out += [(p, ref.span) for p in layers]
            continue
        a, b = (layer_name(cx, n, cfg) for n in (ref.first, ref.last))
        if a is None or b is None:
            continue
        ia, ib = sorted((cfg.layer_index(a), cfg.layer_index(b)))  # either direction
        for layer in cfg.layers[ia : ib + 1]:
            out += [(p.name, ref.span) for p in cfg.layer_params(layer)]
    if len(cx.diag.errors) > errors_before:
        cx.refs_ok = False  # coverage would only repeat the same mistake
    return out


def layer_name(cx: Context, n: Name, cfg: GPTConfig) -> str | None:
    """A layer of the model by name, or None after reporting it."""
    if n.text in cfg.layers:
        return n.text
    _unknown(cx, n, cfg, params=False)
    return None


def _layer_or_param(cx: Context, n: Name, cfg: GPTConfig, *, params: bool) -> list[str] | None:
    """The parameters of a layer, or one parameter by name (where `params`)."""
    if n.text in cfg.layers:
        return [p.name for p in cfg.layer_params(n.text)]
    if params and any(p.name == n.text for p in cfg.params):
        return [n.text]
    _unknown(cx, n, cfg, params=params)
    return None


def _unknown(cx: Context, n: Name, cfg: GPTConfig, *, params: bool) -> None:
    text = n.text
    if text.startswith("h.") and text[2:].isdigit():
        cx.err(
            "layer-range",
            f"the model has no layer {text}",
            n.span,
            hint=f"its blocks are h.0 .. h.{cfg.n_layer - 1}",
        )
        return
    if text in ("lm_head", "lm_head.weight"):
        cx.err(
            "unknown-name",
            f"'{text}' is not a parameter of its own",
            n.span,
            hint="lm_head is tied to the embedding: name wte.weight (or the layer embed)",
        )
        return
    names = list(cfg.layers) + ([p.name for p in cfg.params] if params else [])
    what = "layer or parameter" if params else "layer"
    cx.err(
        "unknown-name",
        f"unknown {what} '{text}'",
        n.span,
        hint=(None if cx.diag.full else did_you_mean(text, names))  # full: unkept
        or f"layers are embed, h.0 .. h.{cfg.n_layer - 1}, head",
    )

"""The model: a named size (`model gpt2`), optionally with overrides (`{ n_layer = 4 }`), or
dimensions alone; `--model` replaces the file's."""

from __future__ import annotations

from typing import Any

from schedc.lang.diagnostics import Diagnostics, did_you_mean
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.keyed import Keys, Reader, read_keyed
from schedc.lang.resolve.values import int_of, one_number
from schedc.lang.syntax import Field, Model
from schedc.model.arch import SIZES, GPTConfig


def _dimension(attr: str, hi: int) -> Reader:
    """A model dimension: a whole number in [1, hi], GPTConfig's `attr`."""

    def read(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
        num = one_number(diag, f)
        n = None if num is None else int_of(diag, num, f.key.text, 1, hi)
        return None if n is None else {attr: n}

    return read


MODEL = Keys(
    "a model",
    "model",
    {
        "n_layer": _dimension("n_layer", 4096),
        "n_head": _dimension("n_head", 4096),
        "n_embd": _dimension("n_embd", 1 << 17),
        "block": _dimension("block_size", 1 << 20),
        "vocab": _dimension("vocab_size", 1 << 22),
    },
)


def resolve_model(cx: Context) -> tuple[str | None, GPTConfig | None]:
    """The model's name as the spec shows it (`gpt2`, `gpt2*` when overridden, `custom`)
    and its config; the config is None where a mistake was reported."""
    m = cx.single(Model, "model", "the model")
    if cx.ov.model is not None:  # an unknown one is reported by Overrides.diagnostics
        return cx.ov.model, SIZES.get(cx.ov.model)
    if m is None:
        return None, None
    base = None
    if m.name is not None:
        base = SIZES.get(m.name.text)
        if base is None:
            cx.err(
                "unknown-model",
                f"unknown model '{m.name.text}'",
                m.name.span,
                hint=did_you_mean(m.name.text, SIZES) or f"known sizes: {', '.join(SIZES)}",
            )
            return m.name.text, None
    read = read_keyed(cx, m.fields, MODEL)
    values = read.values
    if base is None:
        need = [k for k in ("n_layer", "n_head", "n_embd") if k not in values]
        if need:
            cx.err(
                "missing-setting",
                f"a model without a size name needs {', '.join(need)}",
                m.span,
                hint="name a size (`model gpt2`) or give n_layer, n_head, n_embd",
            )
            return "custom", None
        base = GPTConfig()
    if not read.complete:
        return (m.name.text if m.name else "custom"), None  # an error was reported
    try:
        cfg = base.with_overrides(**values)
    except ValueError as e:
        cx.err(
            "model-config",
            str(e),
            m.span,
            hint="n_embd must be a multiple of n_head (head size = n_embd / n_head)",
        )
        return "custom", None
    name = m.name.text if m.name else "custom"
    return (f"{name}*" if values and m.name else name), cfg

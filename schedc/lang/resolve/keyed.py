"""One reader for the settings written as `{ key = value ... }`: a model's overrides, the
optimizer's values and the precision policy's dtypes.

Each block is a Keys table: the keys it takes, each with the reader that checks its value.
The reader of the table says the rest the same way for every block: a key the table lacks is
[unknown-setting] with the nearest key (or the list of them), a key given twice [duplicate],
noting the first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schedc.ir.source import Span
from schedc.lang.diagnostics import Diagnostics, did_you_mean
from schedc.lang.resolve.context import Context
from schedc.lang.syntax import Field

Reader = Callable[[Diagnostics, Field], "dict[str, Any] | None"]
"""A key's value checked: what it sets (a key may set two: betas), or None after saying why
not."""


@dataclass(frozen=True)
class Keys:
    """The keys one block takes, each with the reader of its value."""

    owner: str  # the block as its messages name it: "a model has no 'x'"
    scope: str  # where its keys are recorded in Spec.where: "model.n_layer"
    read: dict[str, Reader]  # in the order a hint lists them


@dataclass(frozen=True)
class Keyed:
    """What a block's fields set, and where each key was given."""

    values: dict[str, Any]
    spans: dict[str, Span]  # the field of each key read
    complete: bool  # every field with a known key was read: none repeated or refused


def read_keyed(cx: Context, fields: tuple[Field, ...], keys: Keys) -> Keyed:
    """A block's fields read by its table, in the order written."""
    values: dict[str, Any] = {}
    spans: dict[str, Span] = {}
    complete = True
    for f in fields:
        key = f.key.text
        if key not in keys.read:
            cx.err(
                "unknown-setting",
                f"{keys.owner} has no '{key}'",
                f.key.span,
                hint=did_you_mean(key, keys.read) or f"keys: {', '.join(keys.read)}",
            )
            continue
        got = None
        if cx.once(f"{keys.scope}.{key}", f.key.span, f"'{key}'"):
            got = keys.read[key](cx.diag, f)
        if got is None:
            complete = False
            continue
        values.update(got)
        spans[key] = f.span
    return Keyed(values, spans, complete)

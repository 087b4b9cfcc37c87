"""What a run measures besides training: `eval { val_every = 250  val_batches = 20 }`, read
by its table. Nothing here enters the step's plan or its proof: evaluation reads the model
between steps and changes no parameter."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from schedc.lang.diagnostics import Diagnostics
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.keyed import Keys, read_keyed
from schedc.lang.resolve.values import int_of, one_number
from schedc.lang.syntax import Evaluation, Field
from schedc.model.config import DataConfig, EvalConfig


def _count(lo: int):
    def read(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
        num = one_number(diag, f)
        v = None if num is None else int_of(diag, num, f.key.text, lo, 1 << 30)
        return None if v is None else {f.key.text: v}

    return read


EVAL = Keys(
    "eval",
    "eval",
    {
        "val_every": _count(0),  # 0: never
        "val_batches": _count(1),
    },
)


def resolve_evaluation(cx: Context, data: DataConfig) -> EvalConfig:
    """The file's `eval` values over the defaults, then the flags' over both. Validation
    reads the `val` shards, so it needs shards: a directory, a glob or a list."""
    e = cx.single(Evaluation, "eval", "the evaluation settings")
    keyed = read_keyed(cx, e.fields, EVAL) if e is not None else None
    config = EvalConfig(**keyed.values) if keyed is not None else EvalConfig()
    if keyed is not None and config.val_every and not data.sharded:
        cx.err(
            "value-range",
            f"validation reads the `val` shards, and {_named(data)} has none",
            keyed.spans["val_every"],
            hint='write `data "shards/"` (scripts/make_shards.py makes them), or val_every = 0',
        )
    if cx.ov.val_every is not None:  # `run --val-every`: checked for shards when it runs
        config = replace(config, val_every=cx.ov.val_every)
    return config


def _named(data: DataConfig) -> str:
    return "the embedded corpus" if data.source == "corpus" else f'"{data.source}"'

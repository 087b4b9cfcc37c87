"""Numerics: what a step computes and communicates in. `precision NAME { compute = ..,
gather = .., reduce = .. }` (a named policy, its dtypes read by a table), `tf32`, `compile`;
`--precision NAME` replaces the file's whole policy."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from schedc.ir.spec import POLICIES, DDPSpec, Dtype, FSDPSpec, Numerics, Strategy
from schedc.lang.diagnostics import Diagnostics, did_you_mean
from schedc.lang.resolve.context import Context, prefer
from schedc.lang.resolve.keyed import Keyed, Keys, read_keyed
from schedc.lang.syntax import Field, Name, Precision

DTYPES = {d.value for d in Dtype}


def _dtype(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """One dtype by name (fp16 is read, then refused for what it needs: loss scaling)."""
    value = f.values[0] if len(f.values) == 1 else None
    text = value.text if isinstance(value, Name) else None
    if text not in DTYPES:
        diag.error("value-range", f"{f.key.text} takes one dtype: fp32 or bf16", f.span)
        return None
    return {f.key.text: Dtype(text)}


PRECISION = Keys("precision", "precision", {"compute": _dtype, "gather": _dtype, "reduce": _dtype})


def resolve_numerics(
    cx: Context, strategy: DDPSpec | FSDPSpec | None, toggles: dict[str, bool]
) -> Numerics:
    """The file's policy and toggles under the flags: a named policy, then its dtypes."""
    p = cx.single(Precision, "precision", "the precision")
    tf32 = prefer(cx.ov.tf32, toggles.get("tf32"), None)
    compile_ = prefer(cx.ov.compile, toggles.get("compile"), False)
    if cx.ov.precision is not None:  # --precision NAME replaces the file's policy
        if cx.ov.precision not in POLICIES:
            cx.err(
                "unknown-name",
                f"--precision {cx.ov.precision}: no such policy",
                None,
                hint=f"policies: {', '.join(POLICIES)}",
            )
            return Numerics(tf32=tf32, compile=compile_)
        return replace(POLICIES[cx.ov.precision], tf32=tf32, compile=compile_)
    if p is None:
        return Numerics(tf32=tf32, compile=compile_)
    base = _policy(cx, p)
    read = read_keyed(cx, p.fields, PRECISION)
    _judge_dtypes(cx, read, strategy)
    numerics = replace(base, **read.values, tf32=tf32, compile=compile_)
    if numerics.gather is not Dtype.FP32 and numerics.compute is Dtype.FP32:
        cx.err(
            "conflict",
            f"gathering in {numerics.gather} rounds the weights to it, but compute is fp32",
            read.spans.get("gather") or read.spans.get("compute") or p.span,
            hint=f"compute in {numerics.gather} too, or gather in fp32",
        )
    return numerics


def _policy(cx: Context, p: Precision) -> Numerics:
    """The named policy the block starts from (fp32 when unnamed or unknown)."""
    if p.name is None or p.name.text in POLICIES:
        return POLICIES[p.name.text if p.name else "fp32"]
    cx.err(
        "unknown-name",
        f"unknown precision policy '{p.name.text}'",
        p.name.span,
        hint=did_you_mean(p.name.text, POLICIES)
        or f"policies: {', '.join(POLICIES)}; or write the dtypes: "
        "`precision { compute = bf16  gather = bf16  reduce = fp32 }`",
    )
    return POLICIES["fp32"]


def _judge_dtypes(cx: Context, read: Keyed, strategy: DDPSpec | FSDPSpec | None) -> None:
    """fp16 anywhere, and a gather dtype where nothing is gathered."""
    for key, dt in read.values.items():
        if dt is Dtype.FP16:
            cx.err(
                "dtype",
                f"{key} = fp16 needs dynamic loss scaling (fp16 overflows "
                "where bf16 does not), which schedc does not do",
                read.spans[key],
                hint=f"use `{key} = bf16`: the same speed, fp32's range",
            )
    if "gather" in read.values and Strategy.of(strategy) is not Strategy.FSDP:
        cx.err(
            "conflict",
            f"gather is the dtype FSDP units are all-gathered in; "
            f"{Strategy.of(strategy).a_label} schedule gathers none",
            read.spans["gather"],
            hint="drop `gather`, or use an fsdp block",
        )

"""The optimizer: `optimizer adamw { lr = 3e-4  betas = 0.9, 0.95 ... }` read by its table.

AdamW runs in fp32, so a value that is fine as a decimal can still break it once rounded to
fp32: where zero or a subnormal (flushed to zero on GPUs) would, the table says how and the
value is refused. weight_decay and min_lr that round to 0 are plain zeros, which AdamW allows.
"""

from __future__ import annotations

import struct
from typing import Any

from schedc.lang.diagnostics import Diagnostics
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.keyed import Keys, Reader, read_keyed
from schedc.lang.resolve.values import int_of, one_number
from schedc.lang.syntax import Field, Num, Optimizer
from schedc.model.config import OptimConfig

FP32_TINY = 2.0**-126  # the smallest normal float32; below it values are subnormal, then 0


def _fp32(v: float) -> float:
    """`v` as the executor holds it: rounded to float32 (struct, so no numpy or torch here)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _rate(*, positive: bool = False, flushed: str | None = None, zero: str = "") -> Reader:
    """A decimal in [0, 1e6) (> 0 if `positive`). Where a value that fp32 holds as 0 or a
    subnormal breaks training, `flushed` says how, and such a value is refused; `zero` says
    what 0 itself means where it is allowed."""

    def read(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
        key, num = f.key.text, one_number(diag, f)
        if num is None:
            return None
        v = num.value
        if not (0 <= v < 1e6) or (positive and v == 0):
            low = "> 0" if positive else ">= 0"
            diag.error(
                "value-range",
                f"{key} = {num.text} is out of range: it must be {low} and below 1e6",
                num.span,
                hint=f"{key} is {RATE_HINTS.get(key, 'a rate')}",
            )
            return None
        if flushed is not None and _fp32(v) < FP32_TINY and not (zero and v == 0):
            got = "0" if _fp32(v) == 0 else f"{_fp32(v):.3g}, a subnormal (0 on a GPU)"
            diag.error(
                "value-range",
                f"{key} = {num.text} is {got} in fp32, {flushed}",
                num.span,
                hint=f"write {key} >= {FP32_TINY:.3g} (fp32's smallest normal number)"
                + (f", or 0 {zero}" if zero else ""),
            )
            return None
        return {key: v}

    return read


# what each value is, for a message about one out of range (GPT-2's in brackets)
RATE_HINTS = {
    "lr": "the peak learning rate (GPT-2 124M: 6e-4)",
    "min_lr": "the floor of the cosine decay (6e-5)",
    "clip": "the largest global gradient norm (1.0; 0 turns clipping off)",
    "eps": "AdamW's epsilon (1e-8)",
    "weight_decay": "the decoupled weight decay (0.1)",
}


def _steps(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """A number of optimizer steps: a whole number in [0, 2^30]."""
    num = one_number(diag, f)
    v = None if num is None else int_of(diag, num, f.key.text, 0, 1 << 30)
    return None if v is None else {f.key.text: v}


def _betas(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """`betas = 0.9, 0.95`: two numbers in [0, 1), kept when outside it (so OptimConfig
    refuses them too)."""
    nums = [v for v in f.values if isinstance(v, Num)]
    if len(nums) != 2 or len(f.values) != 2:
        diag.error("value-range", "betas takes two numbers: `betas = 0.9, 0.95`", f.span)
        return None
    betas = {"beta1": nums[0].value, "beta2": nums[1].value}
    if not all(0 <= b < 1 for b in betas.values()):
        diag.error("value-range", "betas must lie in [0, 1)", f.span)
    return betas


OPTIMIZER = Keys(
    "adamw",
    "optimizer",
    {
        "betas": _betas,
        # the gradient is scaled by clip / norm; clip 0 itself means no clipping
        "clip": _rate(
            flushed="so clipping would scale every gradient to zero",
            zero="to turn clipping off",
        ),
        "decay_steps": _steps,
        # a parameter that never gets a gradient has m = v = 0: eps is all that keeps m /
        # (sqrt(v) + eps) from 0 / 0, so eps 0 is refused too
        "eps": _rate(
            flushed="and AdamW divides by sqrt(v) + eps: a parameter that never gets a gradient "
            "(an unused embedding row) would become 0/0 = NaN",
        ),
        # the update is lr x (...)
        "lr": _rate(positive=True, flushed="so no update would change the model"),
        "min_lr": _rate(),
        "warmup": _steps,
        "weight_decay": _rate(),
    },
)


def resolve_optimizer(cx: Context) -> OptimConfig:
    """AdamW with the file's values over its defaults."""
    o = cx.single(Optimizer, "optimizer", "the optimizer")
    if o is None:
        return OptimConfig()
    if o.name.text != "adamw":
        cx.err(
            "unknown-name",
            f"unknown optimizer '{o.name.text}'",
            o.name.span,
            hint="schedc runs `adamw` (decoupled weight decay, as in GPT-2 training)",
        )
    values = read_keyed(cx, o.fields, OPTIMIZER).values
    try:
        return OptimConfig(**values)
    except ValueError as e:
        cx.err("value-range", f"optimizer: {e}", o.span)
        return OptimConfig()

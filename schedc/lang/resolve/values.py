"""Numbers as a schedule writes them: whole numbers within bounds, sizes with units.

One rule reads a number from a file and from a flag: `range_error` and `size_bytes` say the
same words for `world 0` in a file and for `schedc check --steps 0` (the CLI reports those
at `schedc: --steps 0`); `int_of` and `size_of` report them at the number's span.
"""

from __future__ import annotations

from schedc.lang.diagnostics import Diagnostics
from schedc.lang.syntax import Field, Num, Size

# (min, max) of each plain setting; max keeps arithmetic sane and catches typos like 1e40
LIMITS = {
    "world": (1, 1 << 16),
    "micro": (1, 1 << 24),
    "accumulate": (1, 1 << 20),
    "steps": (1, 1 << 30),
    "seed": (0, (1 << 63) - 1),
}
CHUNK = (1, 1 << 24)  # tokens per chunk of the head's loss (`loss chunk N`)
UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
}
MAX_SIZE = 1 << 60  # bytes: a size of 1 EiB or more is a typo, and overflows int64 sums
# what a value out of range means, for the numbers whose name does not say it
RANGE_HINTS = {
    "world": "world is the number of data-parallel ranks",
    "loss chunk": "the number of tokens whose logits the head makes at once, "
    "e.g. `loss chunk 1024`",
}


def range_error(what: str, v: int, lo: int, hi: int, shown: str | None = None) -> str | None:
    """The message for an integer outside [lo, hi] (None when inside), the same for a number
    written in a file and one given as a flag."""
    if lo <= v <= hi:
        return None
    bound = f">= {lo}" if v < lo else f"<= {hi:,}"
    if shown is None:  # `shown`: the text as written, for numbers too long to format
        shown = (
            f"{v:,}" if abs(v) < 10**15 else (str(v) if len(str(v)) <= 40 else f"{str(v)[:20]}...")
        )
    return f"{what} must be {bound}, got {shown}"


def size_bytes(number: float, unit: str, what: str = "a size", text: str | None = None) -> int:
    """A size in bytes (`memory 80 GiB`, `tune --budget 80GiB`): a whole number of bytes,
    at least 1 and below MAX_SIZE, or ValueError saying so."""
    v = number * UNITS[unit]
    shown = f"{text if text is not None else f'{number:g}'} {unit}".rstrip()
    if v >= MAX_SIZE:
        raise ValueError(f"{what} must be below 1 EiB (2^60 bytes), got {shown}")
    if not v >= 1 or v != int(v):
        raise ValueError(f"{what} must be a positive whole number of bytes, got {shown}")
    return int(v)


def int_of(diag: Diagnostics, num: Num, what: str, lo: int, hi: int) -> int | None:
    """A whole number in [lo, hi] as written, or None after reporting why not."""
    shown = num.text if len(num.text) <= 40 else f"{num.text[:20]}..."
    if not num.is_int:
        diag.error(
            "value-range",
            f"{what} must be a whole number written in digits, not {shown}",
            num.span,
        )
        return None
    huge = len(num.text) > 64  # int() refuses thousands of digits; out of every range
    v = int(num.text) if not huge else (lo - 1 if num.text.startswith("-") else hi + 1)
    if (bad := range_error(what, v, lo, hi, shown if huge else None)) is not None:
        diag.error("value-range", bad, num.span, hint=RANGE_HINTS.get(what))
        return None
    return v


def size_of(diag: Diagnostics, size: Size, what: str) -> int | None:
    """A size in bytes as written (`25 MiB`), or None after reporting why not.

    A number without a unit is refused, not read as bytes: `bucket_cap 25` meant 25 MiB (as
    torch DDP's `bucket_cap_mb=25`), and as bytes it silently made a bucket of every tensor;
    `25 B` says bytes when bytes are meant."""
    if not size.unit:
        n = size.number.text
        diag.error(
            "value-range",
            f"{what} needs a unit: {n} what?",
            size.span,
            hint=f"did you mean `{n} MiB`? (`{n} B` for bytes)",
        )
        return None
    if size.unit not in UNITS:
        diag.error(
            "value-range",
            f"unknown unit '{size.unit}'",
            size.span,
            hint="use B, KB, MB, GB, KiB, MiB or GiB",
        )
        return None
    try:
        return size_bytes(size.number.value, size.unit, what, size.number.text)
    except ValueError as e:
        diag.error("value-range", str(e), size.span)
        return None


def one_number(diag: Diagnostics, f: Field) -> Num | None:
    """The one number of `key = N`, or None after reporting that it takes one."""
    if len(f.values) != 1 or not isinstance(f.values[0], Num):
        diag.error("value-range", f"'{f.key.text}' takes one number", f.span)
        return None
    return f.values[0]

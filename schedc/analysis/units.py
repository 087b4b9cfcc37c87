"""Times and rates as people write them: 3.76 ms, 300 TFLOP/s; and parsed back from flags."""

from __future__ import annotations


def fmt_time(s: float) -> str:
    a = abs(s)
    if a < 1e-12:
        return "0"
    if a >= 1:
        return f"{s:.3g} s" if a < 100 else f"{s:.0f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e9:.3g} ns"


def fmt_rate(x: float, unit: str) -> str:
    for scale, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """'300T', '300e12', '100G', '100GB/s', '2.5 TFLOP/s' -> a positive number per second."""
    t = text.strip().replace(" ", "")
    for tail in ("FLOP/s", "FLOPS", "flop/s", "flops", "B/s", "/s"):
        if t.endswith(tail):
            t = t[: -len(tail)]
            break
    mult = 1.0
    if t and t[-1] in _SI and not t[-1].isdigit():
        mult, t = _SI[t[-1]], t[:-1]
    value = _number(t, text, "a rate: 300T, 3e14, 100GB/s") * mult
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive rate")
    return value


def parse_time(text: str) -> float:
    """'10us', '0.5ms', '1e-5' (seconds) -> seconds."""
    t = text.strip().replace(" ", "")
    for unit in sorted(_TIME, key=len, reverse=True):
        if t.endswith(unit) and t[: -len(unit)]:
            value = _number(t[: -len(unit)], text, "a time: 10us, 0.5ms, 1e-5") * _TIME[unit]
            break
    else:
        value = _number(t, text, "a time: 10us, 0.5ms, 1e-5")
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value


def _number(t: str, text: str, what: str) -> float:
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"{text!r} is not {what}") from None

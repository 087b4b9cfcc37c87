"""The least squares `schedc calibrate` fits with (analysis/calibrate.py): small, exact,
dependency-free solvers for a handful of columns and a few hundred points.

    nnls(rows, ts, required)  -> x or None   t = rows . x with every x >= 0
    line(points)              -> (a, b)      t = a + b x (b None when x does not vary)
    through_origin(points)    -> b           t = b x
    rms(residuals)            -> float
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def nnls(
    rows: Sequence[Sequence[float]], ts: Sequence[float], required: Sequence[int] = ()
) -> list[float] | None:
    """Least squares t = rows . x with every x >= 0: each subset of the columns (those in
    `required` always in) solved by its normal equations, the best feasible one kept; the
    dropped columns are 0. None when no subset has a non-negative solution."""
    n = len(rows[0])
    optional = [j for j in range(n) if j not in required]
    best, best_err = None, math.inf
    for mask in range(1 << len(optional)):
        cols = sorted([*required, *(j for i, j in enumerate(optional) if mask >> i & 1)])
        x = solve(
            [[sum(r[a] * r[b] for r in rows) for b in cols] for a in cols],
            [sum(r[a] * t for r, t in zip(rows, ts)) for a in cols],
        )
        if x is None or any(v < 0 for v in x):
            continue
        full = [0.0] * n
        for j, v in zip(cols, x):
            full[j] = v
        err = sum((t - sum(c * v for c, v in zip(r, full))) ** 2 for r, t in zip(rows, ts))
        if err < best_err * (1 - 1e-12):  # ties go to the fewer columns (found first)
            best, best_err = full, err
    return best


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, columns scaled first); None if singular."""
    n = len(b)
    scale = [math.sqrt(a[i][i]) or 1.0 for i in range(n)]
    m = [[a[i][j] / (scale[i] * scale[j]) for j in range(n)] + [b[i] / scale[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-9:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]


def line(points: Sequence[tuple[float, float]]) -> tuple[float, float | None]:
    """Ordinary least squares t = a + b x; b is None when x does not vary."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 1e-12 * max(1.0, mx * mx) * n:
        return mt, None
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx
    return mt - b * mx, b


def through_origin(points: Sequence[tuple[float, float]]) -> float:
    """Least squares t = b x (0 when every x is 0)."""
    sxx = sum(x * x for x, _ in points)
    return sum(x * t for x, t in points) / sxx if sxx else 0.0


def rms(residuals: Sequence[float]) -> float:
    return math.sqrt(sum(r * r for r in residuals) / len(residuals)) if residuals else 0.0

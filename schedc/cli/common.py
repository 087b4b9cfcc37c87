"""What the verbs share: the flags that override a schedule's own values, number types
for flags, and the check of an output path before any work."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from schedc.lang.diagnostics import CompileError, UserError
from schedc.lang.resolve import Overrides
from schedc.model.arch import SIZES


class RankError(UserError):
    """A run that failed on one rank, said as `schedc: error on rank R: ...` (exit 1)."""

    def __init__(self, rank: str, message: str):
        super().__init__(message)
        self.line = f"schedc: error on rank {rank}: {message}"


def overrides(args) -> Overrides:
    """The flags that override the file, judged by the file's rules before anything compiles
    (so a bad one is said once, not once per schedule): a CompileError, exit 1."""
    ov = Overrides(
        model=getattr(args, "model", None),
        steps=getattr(args, "steps", None),
        seed=getattr(args, "seed", None),
        precision=getattr(args, "precision", None),
        tf32=_switch(getattr(args, "tf32", None)),
        compile=_switch(getattr(args, "compile", None)),
    )
    if diags := ov.diagnostics():
        raise CompileError(diags)
    return ov


def _switch(value: str | None) -> bool | None:
    return None if value is None else value == "on"


def add_override_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="SIZE",
        help=f"model size: {', '.join(SIZES)} (overrides the file)",
    )
    p.add_argument(
        "--steps", type=int, metavar="N", help="optimizer steps to train (overrides the file)"
    )
    p.add_argument(
        "--seed", type=int, metavar="N", help="seed of weights and data order (overrides the file)"
    )
    p.add_argument(
        "--precision",
        metavar="POLICY",
        help="numerics policy: fp32 or bf16 (replaces the file's `precision`)",
    )
    p.add_argument(
        "--tf32",
        choices=["on", "off"],
        help="TF32 for fp32 matmuls on CUDA (overrides the file; default on with CUDA)",
    )
    p.add_argument(
        "--compile",
        choices=["on", "off"],
        help="torch.compile each layer or fused run of layers (overrides the file)",
    )


def _number(kind, lo, hi=None, *, what: str):
    """An argparse `type=` for a number in [lo, hi] (finite): anything else is a usage error."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not (math.isfinite(v) and v >= lo and (hi is None or v <= hi)):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return v

    parse.__name__ = what  # argparse names the type in "invalid <name> value"
    return parse


# --timeout: > 0 and finite (gloo and NCCL take whole milliseconds, datetime.timedelta
# overflows near 1e14 s); a million seconds is eleven days of waiting.
TIMEOUT_S = _number(float, 0.001, 1e6, what="number of seconds")
POSITIVE = _number(int, 1, what="whole number >= 1")
COUNT = _number(int, 0, what="whole number >= 0")


def check_output(flag: str, path: str | None, *, directory: bool = False) -> Path | None:
    """Refuse, before any work, an output that cannot be written, so a typo costs no compile,
    training or layout: a file (-o, --trace, --log-json) that is a directory or whose
    directory is missing, or a checkpoint directory (--save) that is a file or whose parent
    is missing. A file is tried for real: opened to append if it exists, else created and
    removed again, the one test that also holds in /proc, on read-only file systems and for
    root, whom os.access never refuses. The OS still has the last word when it is written."""
    if not path:
        return None
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        raise UserError(
            f"{flag} {path}: " + ("not a directory" if directory else "is a directory, not a file")
        )
    parent = p if directory and p.exists() else p.parent
    if not parent.is_dir():
        raise UserError(
            f"{flag} {path}: "
            + ("no such directory" if not parent.exists() else "not a directory")
            + f": {parent}"
        )
    try:
        if directory:
            if not os.access(parent, os.W_OK):
                raise PermissionError(13, "permission denied")
        elif p.exists():
            if not p.is_file():
                raise UserError(f"{flag} {path}: not a regular file")
            with open(p, "ab"):  # appends nothing; opening is the test
                pass
        else:
            with open(p, "xb"):
                pass
            p.unlink()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise UserError(
            f"{flag} {path}: cannot write: {getattr(e, 'strerror', None) or e}"
        ) from None
    return p

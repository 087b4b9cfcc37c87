"""What the verbs share: the flags that override a schedule's own values, number types
for flags, and the check of an output path before any work."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from schedc.errors import UserError
from schedc.lang.diagnostics import CompileError
from schedc.lang.resolve import Overrides
from schedc.model.arch import SIZES


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
        val_every=getattr(args, "val_every", None),
        sample_every=getattr(args, "sample_every", None),
        hellaswag=getattr(args, "hellaswag", None),
        hellaswag_every=getattr(args, "hellaswag_every", None),
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
    training or layout: an empty value; a name longer than its file system allows; a file
    (-o, --trace, --log-json) that is a directory, not a regular file, or whose directory
    is missing; a checkpoint directory (--save) that is a file or whose parent is missing.
    Writability is tried for real, by creating a probe of a name of its own beside the path
    (inside the directory, for a directory that exists) and removing it: the one test that
    also holds in /proc, on read-only file systems and for root, whom os.access never
    refuses, and that never touches the path itself, which every rank of a job checks at
    the same moment. The OS still has the last word when it is written."""
    if path is None:
        return None
    if not path.strip():
        raise UserError(f"{flag}: the path is empty")
    p = Path(path)
    _name_fits(flag, path, p)
    try:
        exists = p.exists()
    except (OSError, ValueError) as e:  # ValueError: a NUL; OSError: a name too long
        raise UserError(f"{flag} {path[:80]}: {getattr(e, 'strerror', None) or e}") from None
    if exists and p.is_dir() != directory:
        raise UserError(
            f"{flag} {path}: " + ("not a directory" if directory else "is a directory, not a file")
        )
    if exists and not directory and not p.is_file():
        raise UserError(f"{flag} {path}: not a regular file")
    parent = p if directory and exists else p.parent
    if not parent.is_dir():
        raise UserError(
            f"{flag} {path}: "
            + ("no such directory" if not parent.exists() else "not a directory")
            + f": {parent}"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".schedc-probe-")
        os.close(fd)
        os.unlink(probe)
        if exists and not directory:
            with open(p, "ab"):  # appends nothing; opening is the test
                pass
    except (OSError, ValueError) as e:
        raise UserError(
            f"{flag} {path}: cannot write: {getattr(e, 'strerror', None) or e}"
        ) from None
    return p


def _name_fits(flag: str, path: str, p: Path) -> None:
    """A file name longer than its file system allows (the OS says only 'File name too
    long', and only when it is written)."""
    try:
        longest = os.pathconf(p.parent if p.parent.is_dir() else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    n = len(p.name.encode(errors="surrogateescape"))
    if n > longest:
        raise UserError(
            f"{flag} {path[:60]}...: the file name is {n} bytes, more than the {longest} its "
            "file system allows"
        )


def check_distinct(
    *outputs: tuple[str, str | None], inputs: tuple[tuple[str, str | None], ...] = ()
) -> None:
    """Refuse two output flags that name the same path (`tune -o X --write-top X`): the
    second would fail after all the work, or overwrite the first; and an output that names
    a file the command reads (`run s.sched --log-json s.sched` appended a log line to the
    schedule, `render t.json --trace t.json -o ...`)."""
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        key = Path(os.path.abspath(path))
        if key in seen:
            raise UserError(f"{flag} {path}: {seen[key]} writes there too; give each its own")
        seen[key] = flag
        for source, read in inputs:
            if read and _same_file(path, read):
                raise UserError(
                    f"{flag} {path}: that is {source}, which this command reads; write elsewhere"
                )


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def option_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def given(args: argparse.Namespace, flag: str) -> bool:
    """Whether the user set `flag` (flags that depend on others default to None, not to
    their documented default, so that setting one alone can be told apart)."""
    value = getattr(args, option_dest(flag), None)
    return not (value is None or value is False)


def require(args: argparse.Namespace, rules: list[tuple[str, str, str]]) -> None:
    """Refuse a flag that would be silently ignored: each rule (flag, needed, why) says that
    `flag` does something only together with `needed` (given, and not 0: `--measure 0`
    measures nothing)."""
    for flag, needed, why in rules:
        if given(args, flag) and not getattr(args, option_dest(needed), None):
            value = getattr(args, option_dest(flag))
            shown = f"{flag} {value}" if value is not True else flag
            raise UserError(f"{shown} {why}: it needs {needed}")


def defaults(args: argparse.Namespace, **values) -> None:
    """Fill in the documented defaults of the flags `require` judged (None until then)."""
    for name, value in values.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def write_candidates(args: argparse.Namespace, texts: list[str], view: str = "") -> list[Path]:
    """`schedc tune`'s files, best first: -o the first; --write-top DIR every one as
    DIR/1.sched, DIR/2.sched, ... (for --measure a temporary folder when neither names one,
    as the runs need files). `view`: the render flags that draw the top three side by side."""
    if args.output:
        Path(args.output).write_text(texts[0])
        print(f"schedc: wrote {args.output} (check it: schedc check {args.output})")
    folder = Path(args.write_top) if args.write_top else None
    if folder is None and args.measure:
        folder = Path(tempfile.mkdtemp(prefix="schedc-tune-"))
    if folder is None:
        return []
    folder.mkdir(exist_ok=True)
    paths = [folder / f"{i + 1}.sched" for i in range(len(texts))]
    for path, text in zip(paths, texts):
        path.write_text(text)
    if args.write_top:
        shown = " ".join(str(p) for p in paths[:3])
        print(
            f"schedc: wrote {len(paths)} files to {folder}/ (side by side: schedc render "
            f"{shown}{view} -o top.svg)"
        )
    return paths

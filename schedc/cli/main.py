"""The `schedc` command: check, run and render schedules.

    schedc check schedules/ddp_overlap.sched [other.sched] [--dump ast|graph|program|plan]
    torchrun --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp.sched
    schedc render schedules/fsdp_prefetch.sched -o fsdp.svg --view timeline
    schedc export ckpt -o gpt2-out     # a checkpoint as a Hugging Face GPT-2

Exit codes: 0 ok; 1 a user error (compiler diagnostics, a bad flag value, a usage error,
a failed run); 2 an internal error (a bug in schedc: a traceback under "internal error").
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import hashlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

from schedc.cli import calibrate, check, export, render, run, tune
from schedc.errors import RunError, UserError
from schedc.exec.launcher import tell_launcher, under_launcher, watch_launcher
from schedc.lang.diagnostics import CompileError

EXIT_USER, EXIT_INTERNAL = 1, 2

# Each verb is a module with HELP, add_arguments(parser) and run(args) -> exit code.
VERBS = {
    "check": check,
    "run": run,
    "render": render,
    "calibrate": calibrate,
    "tune": tune,
    "export": export,
}


def _color(stream) -> bool:
    return (
        stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"
    )


def _report(e: UserError) -> str:
    """A user error as schedc prints it: a schedule's diagnostics rendered, then their count;
    a run's failure with the rank that met it (torchrun's RANK); any other in one line."""
    if isinstance(e, CompileError):
        text = e.render(color=_color(sys.stderr))
        n = e.error_count  # with those past the kept ones, which were only counted
        return f"{text}\n{n:,} error{'s' if n != 1 else ''}"
    if isinstance(e, RunError):
        return f"schedc: error on rank {os.environ.get('RANK', '0')}: {e}"
    return f"schedc: error: {e}"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a user error like any other: exit 1, not argparse's 2
    (2 means a bug in schedc). Subparsers are built from this class too."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        text = f"{self.prog}: error: {message}"
        if self.prog.endswith(" run") and under_launcher():
            tell_launcher(text)
        self.exit(EXIT_USER, text + "\n")


@functools.cache  # argparse takes ~20 ms to build it (gettext and a formatter per flag)
def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb, built once a process: parsing never changes it."""
    from schedc import __version__

    ap = _Parser(prog="schedc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"schedc {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, verb in VERBS.items():
        p = sub.add_parser(name, help=verb.HELP, description=verb.HELP)
        verb.add_arguments(p)
    return ap


def _refuse_blank(args: argparse.Namespace) -> None:
    """An empty or blank value is never a value: `--resume ""` would read as no --resume, and
    `--cost " "` as no cost file. Refused before any work, for every verb's flags and file
    arguments alike."""
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[args.command]._actions:
        value = getattr(args, action.dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and not v.strip():
                name = max(action.option_strings, key=len, default=action.metavar or action.dest)
                raise UserError(f"{name}: the value is empty")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `run` starts its ranks with
    if not (args.command == "run" and under_launcher()):
        return _verb(args)[0]
    watch_launcher()  # from the rank's first second: a killed launcher cannot end it
    # under torchrun: a crash prints its stack (as torch's ErrorHandler would have it), the
    # schedule is compiled before torch is imported (a static error is said at once, not
    # after 14 s of imports), the same error is said once a node, not once a rank, and its
    # text goes where torchrun's report reads it (schedc/exec/launcher.py)
    faulthandler.enable()
    code, text, stack = _verb(args, once=True)
    if code:
        tell_launcher(text, stack)
    return code


def _verb(args: argparse.Namespace, once: bool = False) -> tuple[int, str, str | None]:
    """Run the verb; print its error, if any (`once`: unless a rank of this job on this node
    said the same). Returns (exit code, the error as printed, an internal error's
    traceback)."""
    try:
        _refuse_blank(args)
        return VERBS[args.command].run(args) or 0, "", None
    except UserError as e:
        text = _report(e)
        if once and not _first_to_say(text):
            return EXIT_USER, text, None
        return _say(EXIT_USER, text)
    except KeyboardInterrupt:
        return 130, "schedc: interrupted", None
    except BrokenPipeError:
        return 0, "", None
    except Exception:
        stack = traceback.format_exc()
        text = "schedc: internal error (a bug in schedc; please report it with the schedule):"
        print(text, file=sys.stderr)
        print(stack, file=sys.stderr, end="")
        return EXIT_INTERNAL, text, f"{text}\n{stack}"


def _first_to_say(text: str) -> bool:
    """Whether this rank is the first of its job on this node to say `text`: every rank of a
    job compiles the same schedule, and N copies of one diagnostic say nothing more than
    one. Told by creating a file named by the job (TORCHELASTIC_RUN_ID) and the text's hash,
    exclusively; where that fails, say it."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    digest = hashlib.sha256(f"{job}\n{text}".encode()).hexdigest()[:24]
    path = Path(tempfile.gettempdir()) / f"schedc-said-{os.getuid()}-{digest}"
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def _say(code: int, text: str) -> tuple[int, str, None]:
    print(text, file=sys.stderr, flush=True)
    return code, text, None


if __name__ == "__main__":
    sys.exit(main())

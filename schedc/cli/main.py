"""The `schedc` command: check, run and render schedules.

    schedc check schedules/ddp_overlap.sched [other.sched] [--dump ast|graph|program|plan]
    torchrun --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp.sched
    schedc render schedules/fsdp_prefetch.sched -o fsdp.svg --view timeline

Exit codes: 0 ok; 1 a user error (compiler diagnostics, a bad flag value, a usage error,
a failed run); 2 an internal error (a bug in schedc: a traceback under "internal error").
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from schedc.cli import calibrate, check, render, run, tune
from schedc.lang.diagnostics import CompileError, UserError

EXIT_USER, EXIT_INTERNAL = 1, 2

# Each verb is a module with HELP, add_arguments(parser) and run(args) -> exit code.
VERBS = {"check": check, "run": run, "render": render, "calibrate": calibrate, "tune": tune}


def _color(stream) -> bool:
    return (
        stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"
    )


def _report(e: CompileError) -> int:
    print(e.render(color=_color(sys.stderr)), file=sys.stderr)
    n = e.error_count  # with those past the kept ones, which were only counted
    print(f"{n:,} error{'s' if n != 1 else ''}", file=sys.stderr)
    return EXIT_USER


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a user error like any other: exit 1, not argparse's 2
    (2 means a bug in schedc). Subparsers are built from this class too."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USER, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from schedc import __version__

    ap = _Parser(prog="schedc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"schedc {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, verb in VERBS.items():
        p = sub.add_parser(name, help=verb.HELP, description=verb.HELP)
        verb.add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return VERBS[args.command].run(args) or 0
    except CompileError as e:
        return _report(e)
    except UserError as e:
        print(f"schedc: error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception:
        print(
            "schedc: internal error (a bug in schedc; please report it with the schedule):",
            file=sys.stderr,
        )
        traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

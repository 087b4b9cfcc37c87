"""The root of schedc's user errors. The bottom of the package: it imports nothing of schedc.

A UserError is something the user can fix: `schedc` prints it as one message and exits 1,
never with a traceback (schedc/cli/main.py catches the root, once, for every verb). Anything
else that escapes a verb is a bug in schedc: "internal error", a traceback, exit 2.

Each kind is defined beside the code that raises it: CompileError (a schedule's diagnostics,
lang/diagnostics.py), TraceError (analysis/trace/schema.py), GraphvizMissing (viz/dot.py),
CheckpointError (exec/checkpoint/layout.py), DataError (model/token_files.py). RunError is
here because the CLI says it differently and must name it without importing torch.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix: exit 1, one message, never a traceback."""


class RunError(UserError):
    """A run that failed on one rank, said as `schedc: error on rank R: ...` (every rank that
    meets it says it; exec/executor.py, exec/train.py)."""

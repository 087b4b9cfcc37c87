"""What torchrun hears from a rank that fails: schedc's own error, not "To enable traceback".

torchrun gives each rank a file to write its error into (TORCHELASTIC_ERROR_FILE) and, when
the job fails, shows the first failed rank's file under "Root Cause" in its report; without
one it shows `error_file: <N/A>` and a link to torch's documentation. torch's
`elastic.multiprocessing.errors.record` wraps an entry point so that an exception escaping
it is written there. schedc catches its errors to print them in one line, so `record`
would see none; `recorded` hands it schedc's error as an exception (`Failed`) whose text is
what schedc printed, through an ErrorHandler that writes that text instead of a Python
traceback (an internal error keeps its traceback). Paths that leave by os._exit (a rank
that fails mid-run, train.fail) call `tell_launcher` themselves. Outside torchrun (no
TORCHELASTIC_ERROR_FILE) nothing is written.

torchrun's own process still prints its traceback ending in ChildFailedError: that is the
launcher's, not a rank's, and no rank can change it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record


class Failed(Exception):
    """A verb that failed and has said why: exit `code`, `text` is what it printed, and an
    internal error's traceback."""

    def __init__(self, code: int, text: str, callstack: str | None = None):
        super().__init__(text)
        self.code, self.text, self.callstack = code, text, callstack


def tell_launcher(text: str, callstack: str | None = None) -> None:
    """Write this rank's error where torchrun reads it, in the format torch's ErrorHandler
    writes (torchrun reads `extraInfo.py_callstack` as the "traceback" it shows, and the
    timestamp to find the first failure). The first error of a rank is kept: later ones
    (its exit, a SIGTERM after it) are consequences."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {
        "message": {
            "message": text.strip().splitlines()[0] if text.strip() else "schedc failed",
            "extraInfo": {
                "py_callstack": (callstack or text).rstrip("\n"),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then says `error_file: <N/A>`; the rank's stderr has the error


class _SchedcErrors(ErrorHandler):
    """torch's ErrorHandler (its `initialize` enables faulthandler), writing schedc's text."""

    def record_exception(self, e: BaseException) -> None:
        if isinstance(e, Failed):
            tell_launcher(e.text, e.callstack)
        else:
            super().record_exception(e)


def recorded(verb: Callable[..., tuple[int, str, str | None]]) -> Callable[..., int]:
    """`verb`, which prints its own errors and returns (exit code, what it printed, an
    internal error's traceback or None), under torch's `record`: under torchrun a failure's
    text reaches torchrun's report. Returns the exit code."""

    def entry(*args) -> int:
        code, text, callstack = verb(*args)
        if code:
            raise Failed(code, text, callstack)  # for record to write; caught below
        return code

    wrapped = record(entry, error_handler=_SchedcErrors())

    def call(*args) -> int:
        try:
            return wrapped(*args) or 0
        except Failed as e:
            return e.code

    return call

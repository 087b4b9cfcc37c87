"""What torchrun hears from a rank that fails: schedc's own error, not "To enable traceback".

torchrun gives each rank a file to write its error into (TORCHELASTIC_ERROR_FILE) and, when
the job fails, shows the first failed rank's file under "Root Cause" in its report; without
one it shows `error_file: <N/A>` and a link to torch's documentation. schedc catches its
errors to print them in one line, so torch's `record` decorator would see none: the CLI
(cli/main.py) hands `tell_launcher` what it printed instead (an internal error keeps its
traceback), and paths that leave by os._exit (a rank that fails mid-run, failures.fail)
call it themselves. Outside torchrun (no TORCHELASTIC_ERROR_FILE) nothing is written.
Nothing here imports torch: a static error is told without waiting for it.

torchrun's own process still prints its traceback ending in ChildFailedError: that is the
launcher's, not a rank's, and no rank can change it.
"""

from __future__ import annotations

import json
import os
import time


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

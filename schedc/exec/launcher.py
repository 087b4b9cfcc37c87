"""Starting a job's ranks, and what a rank hears from and tells its launcher.

`schedc run FILE` on one node starts the file's ranks itself (`start_ranks`), with torch's
elastic launcher as `torchrun --standalone` does, so that the world is said once, in the
file; under torchrun (several nodes, or by choice) each rank is started by torchrun as
before. Either way the launcher gives each rank a file to write its error into
(TORCHELASTIC_ERROR_FILE): schedc catches its errors to print them in one line, so torch's
`record` decorator would see none, and the CLI (cli/main.py) hands `tell_launcher` what it
printed instead (an internal error keeps its traceback); paths that leave by os._exit (a
rank that fails mid-run, failures.fail) call it themselves. A rank whose launcher dies
leaves within a second (`watch_launcher`): its launcher would have ended it.

Nothing here imports torch at import time: a static error is told without waiting for it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import NoReturn


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


# -- a rank's launcher ------------------------------------------------------------------------

LAUNCHER_POLL_S = 0.5  # how often a rank looks for its launcher
LEFT = 1  # a rank's exit status when it leaves because its launcher is gone


def under_launcher() -> bool:
    """Whether this process is a rank that torchrun (or `start_ranks`) started: the launcher
    gives every rank an error file (and RANK, WORLD_SIZE, MASTER_ADDR ...)."""
    return bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))


_parent: int | None = None  # the launcher `watch_launcher` watches


def watch_launcher(poll_s: float = LAUNCHER_POLL_S) -> None:
    """Leave, saying why, when the launcher that started this rank dies: a launcher killed by
    SIGKILL (an out-of-memory kill, a timeout's kill, a user's `kill -9`) cannot end its ranks,
    which are in sessions of their own, and they would train on alone, their peers' sockets
    broken. Seen by the rank's parent changing (an orphan is adopted by init or a subreaper);
    a daemon thread that needs only the GIL, so a main thread blocked in a collective does
    not stop it. A rank that fails meanwhile (its peer left first) asks `launcher_gone`."""
    global _parent
    _parent = os.getppid()
    if _parent <= 1:  # adopted already: nothing to watch
        _parent = None
        return

    def watch() -> None:
        while not launcher_gone():
            time.sleep(poll_s)
        leave()

    threading.Thread(target=watch, name="schedc-launcher", daemon=True).start()


def launcher_gone() -> bool:
    """Whether the launcher `watch_launcher` watches has died."""
    return _parent is not None and os.getppid() != _parent


def leave() -> NoReturn:
    """Say that the launcher is gone, and exit: nothing more this rank does reaches anyone."""
    text = (
        f"schedc: rank {os.environ.get('RANK', '?')}: its launcher (pid {_parent}) is gone, so "
        "no one would end this job: leaving"
    )
    os.write(2, (text + "\n").encode())  # unbuffered: no lock another thread may hold
    os._exit(LEFT)


# -- starting a job's ranks -------------------------------------------------------------------


def start_ranks(world: int, argv: list[str]) -> int:
    """Run `python -m schedc <argv>` as `world` ranks on this node, as `torchrun --standalone
    --nproc_per_node=WORLD` would (torch's elastic agent: a c10d rendezvous on a free port, no
    restarts), and return the job's exit status. The ranks print their own lines, an error
    once a node (cli/main.py); a rank that dies without a word (a signal) is named here. The
    agent's own log lines and torch's ChildFailedError traceback are not shown: they say that a
    child failed, which the rank said better."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if world > 1:  # as torchrun: one thread a rank unless the user chose (exec/train.py)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,  # a rank's exit is seen within 0.1 s
    )
    try:
        elastic_launch(config, sys.executable)("-m", "schedc", *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal: the rank could say nothing
            name = signal.Signals(-failure.exitcode).name
            print(
                f"schedc: rank {rank} (pid {failure.pid}) was killed by {name}: the job is over",
                file=sys.stderr,
                flush=True,
            )
            return 128 - failure.exitcode
        return failure.exitcode
    except (SignalException, KeyboardInterrupt) as e:
        sig = getattr(e, "sigval", signal.SIGINT)
        print(f"schedc: interrupted ({sig.name}): the ranks were ended", file=sys.stderr)
        return 128 + int(sig)
    return 0

"""Starting schedc in processes of its own, as a user would: plain, under torchrun, or as
ranks started by hand.

Every child runs this checkout (first on PYTHONPATH, then whatever PYTHONPATH held: on the
GPU machine the site folder its wheels were installed into, so replacing it would break
`import lark`), outside any job this process may itself be a rank of, and with one thread
per rank where ranks share the machine (OMP_NUM_THREADS=1 when N >= 2), unless the test's
`env` says otherwise.

    python(*argv)             `python ARGV`, finished (text output)
    start_python(*argv)       the same, running (`schedc run` of a world-N file: its launcher)
    torchrun(n, *args)        `schedc run ARGS` on n CPU ranks under torchrun, finished
    start_torchrun(n, *args)  the same, running: read its steps as they come
    start_ranks(per_rank)     `schedc run ARGS[r]` per rank with torchrun's environment but
                              no torchrun; `finish(procs)` collects them

A process started here that is still running when its test ends is killed, with torchrun's
workers (tests/conftest.py calls `reap`): a failed assertion never leaves a 100000-step job
behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.goldens import REPO

# what torchrun gives its workers: left out of a child's environment, where it would make
# the child a rank of whatever job this process may be part of
JOB_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_started: list[subprocess.Popen] = []


def child_env(env: Mapping[str, str] | None = None, ranks: int = 1) -> dict[str, str]:
    """os.environ for a child of `ranks` ranks on this machine, then `env` over it."""
    base = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    threads = {"OMP_NUM_THREADS": "1"} if ranks >= 2 else {}
    return {**base, "PYTHONPATH": path, **threads, **(env or {})}


def python(
    *argv: str,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = 300,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python ARGV` with this checkout, finished: its exit code and text output."""
    return subprocess.run(
        [sys.executable, *argv],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=child_env(env),
    )


def _torchrun_argv(n: int, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone"] + [
        f"--nproc_per_node={n}",
        *("-m", "schedc", "run"),
        *args,
    ]


def torchrun(
    n: int,
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`schedc run ARGS` on `n` CPU ranks under torchrun, finished."""
    return subprocess.run(
        _torchrun_argv(n, args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=child_env(env, ranks=n),
    )


def _start(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _started.append(p)
    return p


def start_torchrun(
    n: int, *args: str, env: Mapping[str, str] | None = None, cwd: Path = REPO
) -> subprocess.Popen[str]:
    """`schedc run ARGS` on `n` CPU ranks under torchrun, running, its output unbuffered."""
    return _start(
        _torchrun_argv(n, args), child_env({"PYTHONUNBUFFERED": "1", **(env or {})}, n), cwd
    )


def start_python(
    *argv: str, ranks: int = 1, env: Mapping[str, str] | None = None, cwd: Path = REPO
) -> subprocess.Popen[str]:
    """`python ARGV` running, its output unbuffered: `schedc run` of a `ranks`-rank schedule
    starts its ranks itself (exec/launcher.py), as children of this process."""
    return _start(
        [sys.executable, *argv], child_env({"PYTHONUNBUFFERED": "1", **(env or {})}, ranks), cwd
    )


def free_port() -> int:
    """A TCP port nobody listens on now, for MASTER_PORT (pytest-xdist runs two suites)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(
    per_rank: Sequence[Sequence[str]],
    env: Mapping[str, str] | None = None,
    cwd: Path | Sequence[Path] = REPO,
) -> list[subprocess.Popen[str]]:
    """`schedc run ARGS[r]` as one process per rank, in the environment torchrun gives its
    workers, but without torchrun: it would SIGTERM the survivors the moment one rank dies,
    and these tests want to see what a survivor reports itself; each rank may have its own
    arguments (torchrun gives every rank the same) and its own working directory."""
    world = len(per_rank)
    job = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    }
    base = child_env({**job, **(env or {})}, ranks=world)
    dirs = [cwd] * world if isinstance(cwd, Path) else list(cwd)
    return [
        _start(
            [sys.executable, "-m", "schedc", "run", *args],
            {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            dirs[r],
        )
        for r, args in enumerate(per_rank)
    ]


def finish(
    procs: Sequence[subprocess.Popen[str]], timeout: float = 240
) -> list[tuple[int, str, str]]:
    """Each rank's (exit code, stdout, stderr); every rank is killed if one outlives the
    bound."""
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank did not exit within the bound") from None
        out.append((p.returncode, o, e))
    return out


def wait_for_step(p: subprocess.Popen[str], step: int, timeout: float = 180) -> str:
    """Read rank 0's output until it logs `step`; what it printed until then."""
    assert p.stdout is not None
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        seen.append(line)
        if line.startswith(f"step {step:4d}"):
            return "".join(seen)
        if not line and p.poll() is not None:
            err = p.stderr.read() if p.stderr else ""
            raise AssertionError(f"ended before step {step} ({p.returncode}):\n{err}")
    raise AssertionError(f"no step {step} within {timeout}s:\n" + "".join(seen))


def workers(p: subprocess.Popen[str]) -> dict[int, int]:
    """{local rank: pid} of a running launcher's workers, torchrun's or `schedc run`'s
    (Linux: pgrep and /proc)."""
    ranks = {}
    children = subprocess.run(
        ["pgrep", "-P", str(p.pid)], capture_output=True, check=False, text=True
    ).stdout.split()
    for pid in children:
        with contextlib.suppress(OSError):  # a worker that has just exited
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            local = [e for e in env if e.startswith(b"LOCAL_RANK=")]
            if local:
                ranks[int(local[0].split(b"=")[1])] = int(pid)
    return ranks


def reap() -> None:
    """Kill what was started here and still runs (torchrun's workers first: each runs in a
    session of its own, so killing torchrun alone would leave them)."""
    while _started:
        p = _started.pop()
        if p.poll() is None:
            for pid in workers(p).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.kill()
            p.wait(timeout=10)

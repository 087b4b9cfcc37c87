"""Heartbeats: a rank that stops answering is named within seconds, whatever --timeout is.

A collective waits for a missing peer until --timeout (300 s by default), since a slow
peer (a long compile, a big first step) must not fail the job. A stopped one (SIGSTOP, a
hung host, a frozen VM) is different, and tells itself apart: it cannot even run a thread.
So every rank of a job runs one daemon thread that, once a second, writes a beat to the
rendezvous store (a counter and the plan instruction the rank is at) and reads the beat of
one peer, the next rank round the ring: every rank is watched by exactly one other, and
the store sees world reads a second, not world squared. A peer whose beat has not changed
for `stale_s` seconds (10, or --timeout if shorter) is reported by its watcher, with its
last instruction; the watcher fails the job as any failing rank does (exec/failures.py
`fail`). A rank that finishes writes `done` and is watched no more.

The beats start as soon as a rank has torch, before the job's rendezvous, so a rank is
watched through start-up too. There a peer may not have beaten yet only because it is
slower to start (imports on a loaded host), so a peer is judged by its beats once it has
beaten or once the job has joined (`joined`); before that a peer on this node is watched
through its process instead (Linux's /proc: a sibling under the same launcher with the
peer's RANK): stopped for `stale_s`, it is named and sent SIGCONT, so the launcher's
SIGTERM can end it. A peer on another node that stops before its first beat is named by
the rendezvous, at --timeout.

The thread talks to the store over a connection of its own (MASTER_ADDR, MASTER_PORT, as
torchrun sets them), so a main thread blocked in a store call (a barrier waiting for a
slow peer) cannot stop its beats. Without those variables (a job started otherwise)
there are no heartbeats, and --timeout alone bounds the wait.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

BEAT_S = 1.0
STALE_S = 10.0
CONNECT_S = 60.0  # how long the beating thread tries to reach the store (rank 0 may host it)
DONE = b"done"


class Heartbeat:
    """One rank's beats and its watch on the next rank (module docstring)."""

    def __init__(
        self,
        rank: int,
        world: int,
        stale_s: float,
        position: Callable[[], str],
        on_stale: Callable[[str], None],  # what the watched rank does, said
    ):
        self.rank, self.world, self.stale_s = rank, world, stale_s
        self.position, self.on_stale = position, on_stale
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"schedc/beat/{attempt}"  # a restarted job does not read old beats
        self.store: TCPStore | None = None  # this thread's own connection, once made
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.all_joined = False  # the job's rendezvous has completed

    def start(self) -> bool:
        """Start beating from a thread that first connects to the store (the main thread goes
        on to the rendezvous meanwhile: started by hand, rank 0 hosts the store there); False
        (and nothing started) where there is no store to use."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if self.world < 2 or not addr or not port:
            return False
        self.thread = threading.Thread(
            target=self._run, args=(addr, int(port)), name="schedc-heartbeat", daemon=True
        )
        self.thread.start()
        return True

    def joined(self) -> None:
        """The job has joined (every rank is past its rendezvous, so beating): a peer that
        has not beaten since is judged as one whose beats stopped."""
        self.all_joined = True

    def done(self) -> None:
        """This rank finished: its watcher stops watching it, and the beating thread ends
        (joined: none is left inside a store call while the process exits)."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=2 * BEAT_S)
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}/{self.rank}", DONE.decode())
            except Exception:  # noqa: BLE001, S110 - the job is over either way
                pass

    def _beat(self, store: TCPStore, n: int) -> None:
        store.set(f"{self.prefix}/{self.rank}", f"{n} {self.position()}")

    def _connect(self, addr: str, port: int) -> TCPStore | None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                addr, port, is_master=False, timeout=datetime.timedelta(seconds=CONNECT_S)
            )
        except (RuntimeError, ValueError):  # not reachable as a client: --timeout alone
            return None
        self.store = store
        return store

    def _run(self, addr: str, port: int) -> None:
        store = self._connect(addr, port)
        if store is None or self.stop.is_set():
            return
        peer = (self.rank + 1) % self.world
        key = f"{self.prefix}/{peer}"
        local = LocalPeer(peer)
        last, since, n = None, time.monotonic(), 0
        while not self.stop.is_set():
            try:
                self._beat(store, n)
                seen = store.get(key) if store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store's host is gone: the collectives say so
                seen, since = last, time.monotonic()  # no beat is judged without the store
            n += 1
            now = time.monotonic()
            if seen == DONE:
                last, since = seen, now  # it finished; it beats no more, and says no more
            elif (stopped := local.stopped_for(now)) > self.stale_s:  # beaten or not
                self.on_stale(
                    f"rank {peer}'s process (pid {local.pid}, this node) has been stopped "
                    f"for {stopped:.0f}s, at {_where(seen)} (SIGSTOP or a debugger)"
                )
                return
            elif seen is None and not self.all_joined:
                since = now  # still starting, maybe slower than this rank: not judged yet
            elif seen != last:
                last, since = seen, now
            elif now - since > self.stale_s:
                self.on_stale(
                    f"rank {peer} has sent no heartbeat for {now - since:.0f}s, last at "
                    f"{_where(seen)}: it is stopped or its host is gone (a slow rank still beats)"
                )
                return
            self.stop.wait(BEAT_S)


def _where(beat: bytes | None) -> str:
    """The plan position a beat names (`3 step 2, instruction 7 (...)`)."""
    text = (beat or b"").decode(errors="replace")
    return text.split(" ", 1)[1] if " " in text else "start-up, before its first beat"


class LocalPeer:
    """A peer rank's process, when it runs on this node: a sibling of this process (the same
    parent: the launcher) whose environment has the peer's RANK and this job's MASTER_PORT.
    Found once, through /proc (Linux); elsewhere, or on another node, never found. Only such
    a process is ever signalled, so a reused pid is never touched."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pid: int | None = None
        self.looked = False
        self.since: float | None = None  # when it was first seen stopped, in this stop

    def _find(self) -> int | None:
        parent, job = os.getppid(), os.environ.get("MASTER_PORT", "")
        want = {f"RANK={self.rank}".encode(), f"MASTER_PORT={job}".encode()}
        for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                if _stat(entry)[1] != parent:
                    continue
                if want <= set((entry / "environ").read_bytes().split(b"\0")):
                    return int(entry.name)
        return None

    def state(self) -> str:
        """Its process's state letter (/proc/PID/stat: R, S, D, T stopped, t traced ...), or
        "" when it is not on this node or gone."""
        if not self.looked:  # the launcher started every local rank before any of them ran
            self.looked, self.pid = True, self._find()
        if self.pid is None:
            return ""
        try:
            return _stat(Path(f"/proc/{self.pid}"))[0]
        except (OSError, ValueError, IndexError):
            return ""

    def stopped_for(self, now: float) -> float:
        """Seconds its process has been stopped, as seen from here (0: running, gone, or
        not on this node)."""
        if self.state() not in ("T", "t"):  # stopped, or stopped by a debugger
            self.since = None
            return 0.0
        self.since = self.since or now
        return now - self.since

    def wake(self) -> bool:
        """SIGCONT its process if it is stopped: a stopped process cannot act on the
        launcher's SIGTERM (torchrun waits 30 s more, then SIGKILLs); continued, it takes the
        SIGTERM at once, or fails on its own on its dead peer. True if it was stopped."""
        if self.state() != "T" or self.pid is None:
            return False
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGCONT)
        return True


def _stat(proc: Path) -> tuple[str, int]:
    """(state, parent pid) of a process, from /proc/PID/stat (the name may hold spaces)."""
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])

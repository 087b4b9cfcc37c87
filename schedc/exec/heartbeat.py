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

The thread talks to the store over a connection of its own (MASTER_ADDR, MASTER_PORT, as
torchrun sets them), so a main thread blocked in a store call (a barrier waiting for a
slow peer) cannot stop its beats. Without those variables (a job started otherwise)
there are no heartbeats, and --timeout alone bounds the wait.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

BEAT_S = 1.0
STALE_S = 10.0
DONE = b"done"


class Heartbeat:
    """One rank's beats and its watch on the next rank (module docstring)."""

    def __init__(
        self,
        rank: int,
        world: int,
        stale_s: float,
        position: Callable[[], str],
        on_stale: Callable[[int, float, str], None],
    ):
        self.rank, self.world, self.stale_s = rank, world, stale_s
        self.position, self.on_stale = position, on_stale
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"schedc/beat/{attempt}"  # a restarted job does not read old beats
        self.store: TCPStore | None = None  # this thread's own connection, once started
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> bool:
        """Connect and start beating; False (and nothing started) without a store to use."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if self.world < 2 or not addr or not port:
            return False
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=10)
            )
        except (RuntimeError, ValueError):  # the store is not reachable as a client
            return False
        self.store = store
        self._beat(store, 0)
        self.thread = threading.Thread(
            target=self._run, args=(store,), name="schedc-heartbeat", daemon=True
        )
        self.thread.start()
        return True

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

    def _run(self, store: TCPStore) -> None:
        peer = (self.rank + 1) % self.world
        key = f"{self.prefix}/{peer}"
        last, since, n = None, time.monotonic(), 0
        while not self.stop.wait(BEAT_S):
            n += 1
            try:
                self._beat(store, n)
                seen = store.get(key) if store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store's host is gone: the collectives say so
                continue
            if seen == DONE:
                last, since = seen, time.monotonic()
                continue  # it finished; it beats no more, and says nothing more
            now = time.monotonic()
            if seen != last:
                last, since = seen, now
            elif now - since > self.stale_s:
                text = last.decode(errors="replace") if last else ""
                where = text.split(" ", 1)[1] if " " in text else "before its first beat"
                self.on_stale(peer, now - since, where)
                return

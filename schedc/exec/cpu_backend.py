"""The CPU backend: gloo process groups, with the compute stream the main thread.

A compute op is complete when it returns. Each comm stream is a gloo process group with a
single worker thread: collectives issued with async_op semantics run there, first-in
first-out, exactly like work queued on a CUDA stream, while the main thread computes. An
event recorded after a collective is its work handle; a `wait` for it retires that
stream's queue up to it (work.wait(), then the collective's completion step, e.g. adding a
reduce-scattered shard into the gradient). Retiring strictly in issue order keeps every
result bitwise reproducible, and retiring only there and at the update (never when a
collective happens to have finished) frees the buffers a collective holds at a point the
plan names: gloo keeps a copy of a reduce-scatter's input until its work is released, so a
timing-dependent retirement made the peak depend on timing (passes/memory.py counts them
until retired).

Mesh dimensions (HSDP): each group has its own worker thread, so a stream stays first-in
first-out across its groups by launching a collective whose group differs from the one
ahead of it (or that waits behind such a one) only once everything ahead of it has retired
(`_kick`): the replicate all-reduce of a unit's gradient shard reads what its
reduce-scatter wrote on the other group.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from schedc.analysis.trace.write import Timed
from schedc.exec.backends import DONE, Done, Launch, Work, copy_alone, now
from schedc.ir.op import COMPUTE, Op


@dataclass
class _Pending:
    """A collective issued on a comm stream, until it retires."""

    op: Op
    work: Work | None  # None until launched (a launch held back behind another group's work)
    done: Done | None
    issued: int
    finished: list[int] = field(default_factory=list)  # set by the work's future
    retired: bool = False
    pg: Any = None  # the gloo group it runs on
    launch: Launch | None = None  # set while held back


class CPUBackend:
    """gloo: compute on the main thread, one single-threaded process group per comm stream."""

    device = torch.device("cpu")

    def __init__(self, streams: tuple[str, ...], comm, trace: bool, mesh=None, dims=()):
        self.streams = streams
        self.trace = trace
        self.spans: list[Timed] = []
        self.groups = {s: _gloo_groups(comm, s, mesh, dims) for s in streams}
        self.queues: dict[str, deque[_Pending]] = {s: deque() for s in streams}
        self.events: dict[int, tuple[str, _Pending | None]] = {}
        self.last_issued: dict[str, _Pending | None] = {s: None for s in streams}
        self.last_end: dict[str, int] = {s: 0 for s in streams}
        self._watchers: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}

    # compute -------------------------------------------------------------------------------

    def on(self, stream: str) -> contextlib.AbstractContextManager:
        """Where an op's buffers are allocated when it is issued: host memory has no streams."""
        return contextlib.nullcontext()

    def compute(self, stream: str, op: Op, fn: Callable[[], None]) -> None:
        t0 = now()
        fn()
        if self.trace:
            self.spans.append(Timed(op, stream, t0, now()))

    # collectives ---------------------------------------------------------------------------

    def collective(
        self, stream: str, op: Op, launch: Launch, done: Done | None, dim: str | None = None
    ) -> None:
        pg = self.groups[stream][dim]
        q = self.queues[stream]
        p = _Pending(op, None, done, now(), pg=pg, launch=launch)
        q.append(p)
        # a stream is FIFO: work on another group than the one ahead waits for it to retire
        if len(q) == 1 or (q[-2].work is not None and q[-2].pg is pg):
            self._launch(stream, p)
        self.last_issued[stream] = p
        if stream == COMPUTE:
            self._retire(stream, p)  # on the compute stream a collective blocks, like a kernel

    def _launch(self, stream: str, p: _Pending) -> None:
        launch = p.launch
        assert launch is not None, "only work not yet launched is launched"
        p.work, p.launch = launch(p.pg), None
        if self.trace:
            self._watcher(stream).put((p, p.work))

    def _kick(self, stream: str) -> None:
        """Launch the held-back work at the head of a stream's queue, and the work of the
        same group right behind it (everything ahead of the head has retired)."""
        q = self.queues[stream]
        for k, p in enumerate(q):
            if p.work is not None:
                continue
            if k and not (q[k - 1].work is not None and q[k - 1].pg is p.pg):
                break
            self._launch(stream, p)

    def record(self, stream: str, event: int) -> None:
        # the producer was the last op issued on `stream`; a compute op is already complete
        self.events[event] = (stream, self.last_issued[stream] if stream != COMPUTE else None)

    def wait(self, stream: str, event: int) -> None:
        src, pending = self.events[event]
        if pending is not None:
            self._retire(src, pending)  # compute events are complete already

    def mark(self, stream: str) -> object:
        """A point on `stream` (compute: now, for the compute op that just returned is
        complete); `wait_mark` makes another stream wait for it. Used for gathered storage."""
        if stream != COMPUTE:
            raise ValueError("on CPU only compute points are marked (a free runs on compute)")
        return (stream, now())

    def wait_mark(self, stream: str, mark: object) -> None:
        pass  # a compute point is complete when it is marked

    def drain(self) -> None:
        for s, q in self.queues.items():
            while q:
                self._retire(s, q[-1])

    def _retire(self, stream: str, upto: _Pending) -> None:
        q = self.queues[stream]
        while q and not upto.retired:
            if q[0].work is None:
                self._kick(stream)  # the head's predecessors have all retired
            p = q.popleft()
            p.retired = True
            assert p.work is not None, "_kick launched the head"
            p.work.wait()
            if p.done is not None:
                p.done()
            # events and the last-issued slot still point at `p`: drop what it holds (the
            # work keeps its buffers, `done` the unsharded gradient) so memory is freed now
            p.work = p.done = None
            if self.trace:
                while not p.finished:  # the watcher stamps it a moment after wait() returns
                    time.sleep(0)
                end = p.finished[0]
                start = max(p.issued, self.last_end[stream])
                self.last_end[stream] = end
                self.spans.append(Timed(p.op, stream, start, end, p.issued))
        self._kick(stream)

    def synchronize(self) -> None:
        self.drain()

    def _watcher(self, stream: str) -> queue.SimpleQueue:
        """A thread that stamps when each collective of `stream` completes (for traces).

        gloo's reduce-scatter work has no future to call back, so the watcher waits on the
        works in issue order; the stream is first-in first-out, so each stamp is exact.
        """
        if stream not in self._watchers:
            q: queue.SimpleQueue = queue.SimpleQueue()

            def watch() -> None:
                while (item := q.get()) is not None:
                    p, work = item
                    work.wait()
                    p.finished.append(now())

            thread = threading.Thread(target=watch, name=f"schedc-watch-{stream}", daemon=True)
            thread.start()
            self._watchers[stream] = q, thread
        return self._watchers[stream][0]

    def close(self) -> None:
        """The watchers stopped and joined, the process groups let go: all of it while the
        interpreter is whole (gloo's threads torn down at exit abort the process, now and
        then, after a run that succeeded: 'terminate called without an active exception')."""
        for q, _ in self._watchers.values():
            q.put(None)
        for _, thread in self._watchers.values():
            thread.join()
        self._watchers.clear()
        self.groups.clear()

    # collectives' implementations (gloo's process-group methods) ---------------------------

    @staticmethod
    def all_reduce(t: torch.Tensor) -> Launch:
        return lambda pg: DONE if pg.size() == 1 else pg.allreduce([t])

    @staticmethod
    def all_gather(out: torch.Tensor, shard: torch.Tensor) -> Launch:
        return lambda pg: (
            copy_alone(out, shard) if pg.size() == 1 else pg._allgather_base(out, shard)
        )

    @staticmethod
    def reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> Launch:
        return lambda pg: (
            copy_alone(out, full) if pg.size() == 1 else pg._reduce_scatter_base(out, full)
        )

    def keep_alive(self, t: torch.Tensor, stream: str) -> None:
        pass  # host memory is freed only when the last Python reference goes

    def stats(self) -> dict:
        return {}


def _gloo_groups(comm, stream: str, mesh, dims) -> dict[str | None, Any]:
    """A stream's gloo process groups, one worker thread each: the job's ranks (key None),
    and one per mesh dimension whose group is smaller than the job (HSDP)."""
    groups: dict[str | None, Any] = {}
    if not dims or any(len(mesh.members(comm.rank, d)) == comm.world for d in dims):
        groups[None] = _gloo_group(comm, f"stream/{stream}", comm.rank, comm.world)
    for dim in dims:
        members = mesh.members(comm.rank, dim)
        if len(members) == comm.world:
            groups[dim] = groups[None]
        else:  # named by the group's first rank: only its members meet under the name
            name = f"stream/{stream}/{dim}/{members[0]}"
            groups[dim] = _gloo_group(comm, name, mesh.index(comm.rank, dim), len(members))
    return groups


def _gloo_group(comm, name: str, rank: int, size: int):
    """A gloo process group with one worker thread: a FIFO comm stream."""
    default = dist.distributed_c10d._get_default_store()
    store = dist.PrefixStore(f"schedc/{comm.tag}/{name}", default)
    # torch's stubs name this class Options, with threads and devices; at runtime it is
    # _Options, with _threads and _devices (Options is Backend's, without them)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._threads = 1
    opts._timeout = comm.timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)

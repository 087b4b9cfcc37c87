"""Streams, events and collectives: the two backends that execute a plan.

The plan (lower.py) is the same on both; only what a stream and an event are differs.

CUDA: one torch.cuda.Stream per schedule stream, one NCCL process group per comm stream
(its own NCCL stream, so collectives of different streams can overlap), torch.cuda.Event
for each `record`/`wait`, tensors handed across streams kept alive with record_stream.
Gathered units are the exception: the executor keeps their storage until the stream that
allocated it has waited for the free's event (`mark`/`wait_mark`, FSDP2's all-gather state),
so the next gather can reuse it and memory stays bounded by the prefetch window.

CPU: the compute stream is the main thread, so a compute op is complete when it returns.
Each comm stream is a gloo process group with a single worker thread: collectives issued
with async_op semantics run there, first-in first-out, exactly like work queued on a CUDA
stream, while the main thread computes. An event recorded after a collective is its work
handle; a `wait` for it retires that stream's queue up to it (work.wait(), then the
collective's completion step, e.g. adding a reduce-scattered shard into the gradient).
Retiring strictly in issue order keeps every result bitwise reproducible, and retiring only
there and at the update (never when a collective happens to have finished) frees the
buffers a collective holds at a point the plan names: gloo keeps a copy of a
reduce-scatter's input until its work is released, so a timing-dependent retirement made
the peak depend on timing (passes/memory.py counts them until retired).

Mesh dimensions (HSDP): a stream has one process group per dimension its collectives run
over (`Spec.dims`; a dimension whose group is the whole job uses the stream's world group,
so flat DDP and FSDP keep exactly one). On CUDA the groups' NCCL streams are ordered by
the schedule stream they are issued on. On CPU each group has its own worker thread, so a
stream stays first-in first-out across its groups by launching a collective whose group
differs from the one ahead of it (or that waits behind such a one) only once everything
ahead of it has retired (`_kick`): the replicate all-reduce of a unit's gradient shard
reads what its reduce-scatter wrote on the other group.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from schedc.analysis.trace.write import Timed
from schedc.ir.op import COMPUTE, Op

# A collective is given its process group and returns the async work (or None when the
# backend ran it synchronously); `done` runs once its result is complete.
Launch = Callable[[object], object]
Done = Callable[[], None]


class Backend(Protocol):
    """What executes a plan's streams and events: `CPUBackend` (gloo) and `CUDABackend`
    (CUDA streams, NCCL) both, so the executor and the strategies never ask which."""

    spans: list[Timed]  # the ops timed since the last synchronize (tracing)

    def on(self, stream: str) -> contextlib.AbstractContextManager:
        """Where an op's buffers are allocated when it is issued."""

    def compute(self, stream: str, op: Op, fn: Callable[[], None]) -> None:
        """Run `fn`, the op's work, on `stream`."""

    def collective(
        self, stream: str, op: Op, launch: Launch, done: Done | None, dim: str | None = None
    ) -> None:
        """Issue a collective on `stream`, over the group of mesh dimension `dim`; `done`
        runs once its result is complete."""

    def record(self, stream: str, event: int) -> None: ...

    def wait(self, stream: str, event: int) -> None: ...

    def mark(self, stream: str) -> object:
        """A point on `stream` that `wait_mark` makes another stream wait for."""

    def wait_mark(self, stream: str, mark: object) -> None: ...

    def drain(self) -> None:
        """Every collective retired: what the update reads is final."""

    def synchronize(self) -> None: ...

    def all_reduce(self, t: torch.Tensor) -> Launch: ...

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Launch: ...

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Launch: ...

    def keep_alive(self, t: torch.Tensor, stream: str) -> None:
        """`t` is read on `stream` too: its memory must outlive that use."""

    def close(self) -> None: ...

    def stats(self) -> dict: ...


@dataclass
class _Pending:
    op: Op
    work: object  # None until launched (a launch held back behind another group's work)
    done: Done | None
    issued: int
    finished: list[int] = field(default_factory=list)  # set by the work's future
    retired: bool = False
    pg: object = None
    launch: Launch | None = None  # set while held back


def now() -> int:
    return time.perf_counter_ns()


class _Done:
    """The work of a collective over a group of one rank: complete when issued. Such a
    collective communicates nothing: an all-reduce leaves its buffer as it is, an all-gather
    and a reduce-scatter are a copy (a cast, between dtypes) on the issuing stream."""

    def wait(self) -> bool:
        return True


DONE = _Done()


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
        self._watchers: dict[str, queue.SimpleQueue] = {}

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
        p.work, p.launch = p.launch(p.pg), None
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

            threading.Thread(target=watch, name=f"schedc-watch-{stream}", daemon=True).start()
            self._watchers[stream] = q
        return self._watchers[stream]

    def close(self) -> None:
        for q in self._watchers.values():
            q.put(None)

    # collectives' implementations (gloo's process-group methods) ---------------------------

    @staticmethod
    def all_reduce(t: torch.Tensor) -> Launch:
        return lambda pg: DONE if pg.size() == 1 else pg.allreduce([t])

    @staticmethod
    def all_gather(out: torch.Tensor, shard: torch.Tensor) -> Launch:
        return lambda pg: _copy(out, shard) if pg.size() == 1 else pg._allgather_base(out, shard)

    @staticmethod
    def reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> Launch:
        return lambda pg: _copy(out, full) if pg.size() == 1 else pg._reduce_scatter_base(out, full)

    def keep_alive(self, t: torch.Tensor, stream: str) -> None:
        pass  # host memory is freed only when the last Python reference goes

    def stats(self) -> dict:
        return {}


def _copy(out: torch.Tensor, src: torch.Tensor) -> _Done:
    """A gather or reduce-scatter over one rank: its output is its input (cast, if the
    dtypes differ), copied on the issuing stream."""
    out.copy_(src)
    return DONE


def _gloo_groups(comm, stream: str, mesh, dims) -> dict[str | None, object]:
    """A stream's gloo process groups, one worker thread each: the job's ranks (key None),
    and one per mesh dimension whose group is smaller than the job (HSDP)."""
    groups: dict[str | None, object] = {}
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
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 1
    opts._timeout = comm.timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)


class CUDABackend:
    """NCCL: a CUDA stream and a process group per schedule stream, CUDA events between."""

    def __init__(
        self,
        streams: tuple[str, ...],
        comm,
        trace: bool,
        device: torch.device,
        collectives: str = "nccl",
        mesh=None,
        dims=(),
    ):
        self.device = device
        self.trace = trace
        self.streams = {
            s: (torch.cuda.current_stream(device) if s == COMPUTE else torch.cuda.Stream(device))
            for s in streams
        }
        world = stream_groups(streams, comm, collectives)
        self.groups = {
            s: {None: world[s], **mesh_groups(s, world[s], comm, collectives, mesh, dims)}
            for s in streams
        }
        # gloo (several ranks on one GPU, tests): which tensor collectives it lacks on CUDA
        self.fallbacks: set[str] = (
            _gloo_cuda_gaps(world[streams[0]], device) if collectives == "gloo" else set()
        )
        self.events: dict[int, torch.cuda.Event] = {}
        self._spare_marks: list[torch.cuda.Event] = []
        self._timing: list[tuple[Op, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._base: torch.cuda.Event | None = None
        self._base_ns = 0
        self.spans: list[Timed] = []

    def _timed(self, stream: str, op: Op, fn: Callable[[], None]) -> None:
        s = self.streams[stream]
        with torch.cuda.stream(s):
            if not self.trace:
                fn()
                return
            if self._base is None:
                self._base = torch.cuda.Event(enable_timing=True)
                self._base.record(self.streams[COMPUTE])
                self._base_ns = now()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            fn()
            b.record(s)
            self._timing.append((op, stream, a, b))

    def on(self, stream: str) -> contextlib.AbstractContextManager:
        """Allocations made inside belong to `stream`: the caching allocator hands their
        blocks back in that stream's order (an op's buffers, allocated when it is issued)."""
        return torch.cuda.stream(self.streams[stream])

    def compute(self, stream: str, op: Op, fn: Callable[[], None]) -> None:
        self._timed(stream, op, fn)

    def collective(
        self, stream: str, op: Op, launch: Launch, done: Done | None, dim: str | None = None
    ) -> None:
        def issue():
            launch(self.groups[stream][dim])  # synchronous mode: ordered on this stream
            if done is not None:
                done()  # enqueued on the same stream, after the collective

        self._timed(stream, op, issue)

    def record(self, stream: str, event: int) -> None:
        # one Event per plan event, re-recorded every step: a wait enqueued before takes the
        # record that preceded it (cudaStreamWaitEvent), so reuse cannot reorder anything
        e = self.events.get(event)
        if e is None:
            e = self.events[event] = torch.cuda.Event()
        e.record(self.streams[stream])

    def wait(self, stream: str, event: int) -> None:
        self.streams[stream].wait_event(self.events[event])

    def mark(self, stream: str) -> torch.cuda.Event:
        e = self._spare_marks.pop() if self._spare_marks else torch.cuda.Event()
        e.record(self.streams[stream])
        return e

    def wait_mark(self, stream: str, mark: torch.cuda.Event) -> None:
        self.streams[stream].wait_event(mark)
        self._spare_marks.append(mark)  # its one wait is enqueued: free to record again

    def drain(self) -> None:
        for s in self.streams.values():
            torch.cuda.current_stream(self.device).wait_stream(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        if self._timing and self._base is not None:
            for op, stream, a, b in self._timing:
                start = self._base_ns + int(self._base.elapsed_time(a) * 1e6)
                end = self._base_ns + int(self._base.elapsed_time(b) * 1e6)
                self.spans.append(Timed(op, stream, start, end, start))
            self._timing.clear()
            self._base = None

    @staticmethod
    def all_reduce(t: torch.Tensor) -> Launch:
        return lambda pg: DONE if pg.size() == 1 else dist.all_reduce(t, group=pg)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Launch:
        if "all_gather_into_tensor" in self.fallbacks:  # gloo: the list form, into the views

            def gather(pg):
                return dist.all_gather(list(out.chunk(pg.size())), shard, group=pg)
        else:

            def gather(pg):
                return dist.all_gather_into_tensor(out, shard, group=pg)

        return lambda pg: _copy(out, shard) if pg.size() == 1 else gather(pg)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Launch:
        if "reduce_scatter_tensor" in self.fallbacks:
            # gloo without a CUDA reduce-scatter: all-reduce the whole buffer, keep this rank's
            # shard, [rank * s, (rank + 1) * s), the same offsets FlatUnit owns; D/2 x the bytes
            def scatter(pg):
                summed = full.clone()
                dist.all_reduce(summed, group=pg)
                n, me = out.numel(), dist.get_rank(pg)  # this rank's place in the group
                out.copy_(summed[me * n : (me + 1) * n])
        else:

            def scatter(pg):
                return dist.reduce_scatter_tensor(out, full, group=pg)

        return lambda pg: _copy(out, full) if pg.size() == 1 else scatter(pg)

    def keep_alive(self, t: torch.Tensor, stream: str) -> None:
        """`t` is used on `stream` too: the allocator must not reuse it before that use."""
        t.record_stream(self.streams[stream])

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        """The caching allocator's peaks: what tensors held (allocated), what it took from
        the device (reserved: what another process or an OOM sees), and how often it had to
        free its cache and retry an allocation (a sign of fragmentation or a host running
        ahead of the frees)."""
        return {
            "cuda_max_allocated": torch.cuda.max_memory_allocated(self.device),
            "cuda_max_reserved": torch.cuda.max_memory_reserved(self.device),
            "cuda_alloc_retries": torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0),
        }


def stream_groups(streams: tuple[str, ...], comm, backend: str) -> dict[str, object]:
    """One process group per stream, over the job's ranks (`comm.group`'s, or the world's).

    `use_local_synchronization=True`: only the members call new_group and only they join
    its barrier (torch.distributed.new_group's documentation), so schedc can run on a
    subgroup of a larger job; every member creates the groups in the same order (the
    schedule's stream order), which the same documentation asks for to avoid a deadlock
    between overlapping groups.
    """
    ranks = (
        list(range(comm.world)) if comm.group is None else dist.get_process_group_ranks(comm.group)
    )
    return {
        s: dist.new_group(
            ranks, timeout=comm.timeout, backend=backend, use_local_synchronization=True
        )
        for s in streams
    }


def mesh_groups(stream: str, world_pg, comm, backend: str, mesh, dims) -> dict[str, object]:
    """A stream's process group for each mesh dimension: its world group where the
    dimension spans the job, else a new group of this rank's members along it. Every rank
    creates one group per (stream, dimension) in the same order, so the groups torch names
    by their ranks and the count of groups made before them agree among their members."""
    ranks = (
        list(range(comm.world)) if comm.group is None else dist.get_process_group_ranks(comm.group)
    )
    out = {}
    for dim in dims:
        members = mesh.members(comm.rank, dim)
        if len(members) == comm.world:
            out[dim] = world_pg
        else:
            out[dim] = dist.new_group(
                [ranks[m] for m in members],
                timeout=comm.timeout,
                backend=backend,
                use_local_synchronization=True,
            )
    return out


LAUNCH_ORDER = "NCCL_LAUNCH_ORDER_IMPLICIT"


def nccl_launch_order(n_collective_streams: int) -> bool:
    """Order NCCL kernel launches across communicators by host issue order, when more than
    one stream carries collectives; returns whether it is set. Call before any NCCL
    communicator exists (NCCL reads its parameters once per process).

    Several collective streams are several NCCL communicators in flight on one GPU, whose
    kernels can start in different orders on different ranks: a deadlock when both cannot be
    resident. NCCL >= 2.26 orders them by host launch order when NCCL_LAUNCH_ORDER_IMPLICIT=1
    (NCCL user guide, "Using multiple NCCL communicators concurrently", and its environment
    variables page); schedc issues collectives from one thread in the plan's order, which
    the checker proves is the same on every rank. One comm stream needs nothing: the default
    group's scalars (norm, loss) are issued after every comm stream drained into compute,
    and the next step's collectives wait for the step start. A value the user set wins.
    """
    if n_collective_streams < 2:
        return False
    os.environ.setdefault(LAUNCH_ORDER, "1")
    return os.environ[LAUNCH_ORDER] == "1"


def _gloo_cuda_gaps(pg, device: torch.device) -> set[str]:
    """The tensor collectives gloo refuses for CUDA tensors in this torch (it stages
    all-reduce and list all-gather through host memory). Probed once on every rank: a
    refused collective fails before it communicates, so every rank sees the same set."""
    gaps = set()
    world = dist.get_world_size(pg)
    x = torch.ones(world, device=device)
    for name, call in (
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(x.clone(), x[:1], group=pg)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(x[:1].clone(), x, group=pg)),
    ):
        try:
            call()
        except (RuntimeError, NotImplementedError, ValueError):
            gaps.add(name)
    torch.cuda.synchronize(device)
    return gaps

"""The CUDA backend: a CUDA stream and an NCCL process group per schedule stream.

One torch.cuda.Stream per schedule stream, one NCCL process group per comm stream (its own
NCCL stream, so collectives of different streams can overlap), torch.cuda.Event for each
`record`/`wait`, tensors handed across streams kept alive with record_stream. Gathered
units are the exception: the executor keeps their storage until the stream that allocated
it has waited for the free's event (`mark`/`wait_mark`, FSDP2's all-gather state), so the
next gather can reuse it and memory stays bounded by the prefetch window.

Mesh dimensions (HSDP): the groups' NCCL streams are ordered by the schedule stream they
are issued on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from schedc.analysis.trace.write import Timed
from schedc.exec.backends import DONE, Done, Launch, copy_alone, mesh_groups, now, stream_groups
from schedc.ir.op import COMPUTE, Op


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

    def wait_mark(self, stream: str, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event), "a mark this backend made"
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

        return lambda pg: copy_alone(out, shard) if pg.size() == 1 else gather(pg)

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

        return lambda pg: copy_alone(out, full) if pg.size() == 1 else scatter(pg)

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

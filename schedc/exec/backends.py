"""Streams, events and collectives: what both backends that execute a plan share.

The plan (lower.py) is the same on both; only what a stream and an event are differs:
`CPUBackend` (exec/cpu_backend.py: gloo, one worker thread a comm stream) and `CUDABackend`
(exec/cuda_backend.py: CUDA streams and events, NCCL) meet the `Backend` protocol below, so
the executor and the strategies never ask which.

Mesh dimensions (HSDP): a stream has one process group per dimension its collectives run
over (`Spec.dims`; a dimension whose group is the whole job uses the stream's world group,
so flat DDP and FSDP keep exactly one). How each backend keeps a stream in order across
its groups is said in its module.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from schedc.analysis.trace.write import Timed
from schedc.ir.op import Op


class Work(Protocol):
    """A collective's asynchronous work: complete once `wait` returns."""

    def wait(self) -> bool: ...


# A collective is given its process group (gloo's on CPU, a torch ProcessGroup on CUDA: each
# backend hands its own launches its own groups) and returns the async work, or None when
# the backend ran it synchronously; `done` runs once its result is complete.
Launch = Callable[[Any], "Work | None"]
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


def now() -> int:
    return time.perf_counter_ns()


class _Done:
    """The work of a collective over a group of one rank: complete when issued. Such a
    collective communicates nothing: an all-reduce leaves its buffer as it is, an all-gather
    and a reduce-scatter are a copy (a cast, between dtypes) on the issuing stream."""

    def wait(self) -> bool:
        return True


DONE = _Done()


def copy_alone(out: torch.Tensor, src: torch.Tensor) -> Work:
    """A gather or reduce-scatter over one rank: its output is its input (cast, if the
    dtypes differ), copied on the issuing stream."""
    out.copy_(src)
    return DONE


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

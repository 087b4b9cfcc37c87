"""A pool of real gloo ranks for tests, started once per session.

Four worker processes form one gloo world and, up front, subgroups of sizes 1 to 4.
A job (schedule text, world D, steps, options) goes to ranks 0..D-1, which compile it,
run it with schedc's executor on their subgroup, and send back what rank 0 saw: per-step
loss, grad norm, full gradients (before clipping) and parameters (after the update),
plus every rank's measured memory and communication counts.

Nothing here waits without a bound. A job that fails on any rank, outlives its deadline,
or loses a worker (a crash, a kill) raises JobFailed with the schedule text and the
failing rank's plan, and the pool is restarted before the next job, so one broken
schedule never hangs the session or poisons the jobs after it.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any

POOL_SIZE = 4
JOB_TIMEOUT_S = 60.0  # a generated job takes well under 5 s; gloo gives up after this too
START_TIMEOUT_S = 180.0  # four processes importing torch on two cores
STOP_TIMEOUT_S = 10.0


@dataclass
class Job:
    text: str
    world: int
    steps: int = 1
    dtype: str = "float32"
    trace: bool = False
    fault: str | None = None  # a deliberate executor bug (tests of the tests): tests/faults.py
    id: int = 0
    heap: bool = False  # measure the peak live heap (no full tensors recorded, to not add any)
    tf32: str | None = None  # steps inside tests/tf32.py's emulate_tf32(mode): TF32 on a CPU
    log_buffers: bool = False  # every rank's buffer log (Executor.buffer_log)


@dataclass
class JobResult:
    steps: list  # StepStats of rank 0, tensors on CPU
    memory: list[dict] = field(default_factory=list)  # per rank
    comm_bytes: list[dict] = field(default_factory=list)  # per rank, last step
    trace: list[dict] = field(default_factory=list)  # chrome events of every rank
    buffer_log: list[list] = field(default_factory=list)  # per rank, with log_buffers
    linears: int = 0  # rank 0's Linear forwards that ran on emulated TF32 (with tf32)


@dataclass
class Call:
    """`target(rank, groups, *args)` on ranks 0..world-1 ("module:function", imported on the
    worker): any distributed test code on the pool's processes (the pipeline executor's,
    tests/pipeline_ranks.py). `groups[d]` is the group of ranks 0..d-1, `groups["ends", d]`
    that of ranks 0 and d-1. The reply is every rank's return value, in rank order."""

    target: str
    world: int
    args: tuple = ()
    id: int = 0


class JobFailed(AssertionError):
    pass


def _worker(rank: int, size: int, store_dir: str, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S),
    )
    groups: dict = {d: dist.new_group(list(range(d))) for d in range(1, size + 1)}
    for d in range(2, size + 1):  # the first and last rank of ranks 0..d-1 (pipeline ends)
        groups["ends", d] = groups[2] if d == 2 else dist.new_group([0, d - 1])
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the parent is gone: so are we
            break
        if job is None:
            break
        try:
            run = _call if isinstance(job, Call) else _run_job
            conn.send_bytes(_dumps(("ok", run(job, rank, groups))))
        except BaseException:  # noqa: BLE001 - reported to the parent, which restarts us
            conn.send_bytes(_dumps(("error", traceback.format_exc())))
    dist.destroy_process_group()


def _tensor(data: bytes, dtype, shape: tuple[int, ...]):
    import torch

    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    """Tensors as their bytes. torch.multiprocessing would pass each tensor's storage as a
    shared-memory file descriptor, one socket round trip each: about 70 a job, 30 ms of the
    parent's CPU (measured 5x slower than copying the bytes)."""

    def reducer_override(self, obj):
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous()
            return _tensor, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, t.shape)
        return NotImplemented


def _dumps(reply) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(reply)
    return buf.getvalue()


def _call(job: Call, rank: int, groups):
    import importlib

    module, name = job.target.split(":")
    return getattr(importlib.import_module(module), name)(rank, groups, *job.args)


def _run_job(job: Job, rank: int, groups):
    import datetime

    import torch

    from schedc.compiler import compile_text
    from schedc.exec.executor import Executor
    from schedc.exec.options import Comm, RunOptions
    from schedc.lang.resolve import Overrides

    # no proof on the ranks: the test that sent the job compiled the text (its reference, its
    # lifetimes) and proved it there, once, not once per rank of every job
    compiled = compile_text(job.text, f"job{job.id}.sched", Overrides(steps=job.steps), prove=False)
    comm = Comm(
        rank,
        job.world,
        groups[job.world],
        datetime.timedelta(seconds=JOB_TIMEOUT_S),
        tag=f"job{job.id}",
    )
    opts = RunOptions(
        device="cpu",
        dtype=getattr(torch, job.dtype),
        record=not job.heap,
        trace=job.trace,
        log=False,
        heap=job.heap,
        log_buffers=job.log_buffers,
    )
    if job.fault and job.fault.startswith("mutation "):  # a wrong plan, the proof bypassed
        from tests.faults import mutated

        compiled = mutated(compiled, job.fault.split(" ", 1)[1])
    ex = Executor(compiled, comm, opts)
    if job.fault and not job.fault.startswith("mutation "):
        from tests.faults import inject

        inject(ex, job.fault)
    if job.tf32:
        from tests.tf32 import emulate_tf32

        tf32 = emulate_tf32(job.tf32)
    else:
        tf32 = contextlib.nullcontext()
    try:
        with tf32 as em:
            stats = [ex.step() for _ in range(job.steps)]
    finally:
        ex.close()
    if rank != 0:
        for s in stats:
            s.grads, s.params = {}, {}
    return {
        "steps": stats,
        "memory": ex.memory(),
        "comm_bytes": stats[-1].comm_bytes,
        "trace": ex.trace_events() if job.trace else [],
        "buffer_log": ex.buffer_log,
        "linears": em.linears if job.tf32 else 0,
    }


class Pool:
    """`run(text, world, steps)` on real ranks; restarts itself after any failed job."""

    def __init__(self, size: int = POOL_SIZE):
        self.size = size
        self.jobs = 0
        self.restarts = 0
        self.conns: list = []
        self.procs: list = []
        self._dir = None
        self._start()

    # -- lifecycle ----------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="schedc-pool-")
        self.conns, self.procs = [], []
        for r in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.size, self._dir.name, child), daemon=True)
            p.start()
            child.close()  # only the worker holds its end: its death reads as EOF here
            self.conns.append(parent)
            self.procs.append(p)
        deadline = time.monotonic() + START_TIMEOUT_S
        for r, c in enumerate(self.conns):
            try:
                ok = c.poll(max(0.0, deadline - time.monotonic())) and c.recv() == "ready"
            except (EOFError, OSError):
                ok = False
            if not ok:
                code = self.procs[r].exitcode
                self._stop(graceful=False)
                raise RuntimeError(f"test worker pool failed to start (rank {r}, exit code {code})")

    def _stop(self, graceful: bool) -> None:
        if graceful:
            for c in self.conns:
                try:
                    c.send(None)
                except (BrokenPipeError, OSError):
                    pass
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=STOP_TIMEOUT_S)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def close(self) -> None:
        self._stop(graceful=True)

    def restart(self) -> None:
        """Kill every worker (some may be stuck in a collective) and start afresh."""
        self._stop(graceful=False)
        self.restarts += 1
        self._start()

    @property
    def alive(self) -> bool:
        return len(self.procs) == self.size and all(p.is_alive() for p in self.procs)

    # -- jobs ---------------------------------------------------------------------------------

    def run(
        self,
        text: str,
        world: int,
        steps: int = 1,
        *,
        dtype: str = "float32",
        trace: bool = False,
        fault: str | None = None,
        timeout: float = JOB_TIMEOUT_S,
        heap: bool = False,
        tf32: str | None = None,
        log_buffers: bool = False,
    ) -> JobResult:
        """Run the schedule on ranks 0..world-1; JobFailed (with text and plan) if it cannot."""
        assert 1 <= world <= self.size, world
        if not self.alive:  # a worker died between jobs, or the last restart failed
            self.restart()
        self.jobs += 1
        job = Job(text, world, steps, dtype, trace, fault, self.jobs, heap, tf32, log_buffers)
        outs = self._dispatch(job, world, timeout)
        return JobResult(
            outs[0]["steps"],
            [o["memory"] for o in outs],
            [o["comm_bytes"] for o in outs],
            [e for o in outs for e in o["trace"]],
            [o["buffer_log"] for o in outs],
            outs[0]["linears"],
        )

    def call(self, target: str, world: int, *args, timeout: float = JOB_TIMEOUT_S) -> list:
        """`target(rank, groups, *args)` on ranks 0..world-1 (see Call); every rank's return
        value; JobFailed as for `run`."""
        assert 1 <= world <= self.size, world
        if not self.alive:
            self.restart()
        self.jobs += 1
        return self._dispatch(Call(target, world, args, self.jobs), world, timeout)

    def _dispatch(self, job: Job | Call, world: int, timeout: float) -> list:
        """Send `job` to ranks 0..world-1 and return their replies in rank order."""
        deadline = time.monotonic() + timeout
        for r, c in enumerate(self.conns[:world]):
            try:
                c.send(job)
            except (BrokenPipeError, OSError):
                self._fail(job, r, f"rank {r} was gone before the job started")
        replies = self._replies(job, deadline, timeout)
        return [replies[r] for r in range(world)]

    def _replies(self, job: Job | Call, deadline: float, timeout: float) -> dict[int, dict]:
        """Every job rank's reply by the deadline, or JobFailed saying which rank did not."""
        world = job.world
        replies: dict[int, dict] = {}
        pending = dict(enumerate(self.conns[:world]))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                r = min(pending)
                self._fail(
                    job,
                    r,
                    f"rank(s) {sorted(pending)} did not finish within "
                    f"{timeout:.0f}s (hung: a wait that is never satisfied, or "
                    "ranks issuing different collectives)",
                )
            sentinels = {self.procs[r].sentinel: r for r in pending}
            ready = wait_any(list(pending.values()) + list(sentinels), timeout=left)
            # replies first: a worker that answered and then died still answered
            for r, c in list(pending.items()):
                if c not in ready:
                    continue
                try:
                    status, msg = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    self._fail(job, r, f"rank {r} died (exit code {self._exitcode(r)})")
                del pending[r]
                if status != "ok":  # the other ranks may be stuck in a collective
                    self._fail(job, r, self._dead(world) + f"rank {r} failed:\n{msg}")
                replies[r] = msg
            for s, r in sentinels.items():
                if s in ready and r in pending:
                    self._fail(job, r, f"rank {r} died (exit code {self._exitcode(r)})")
        return replies

    def _dead(self, world: int) -> str:
        """'rank R died (exit code C); ' for each job rank that is gone: a failure on
        another rank (a reset connection) is then only its echo."""
        gone = []
        for r in range(world):
            self.procs[r].join(timeout=0.5 if not gone else 0)
            if not self.procs[r].is_alive():
                gone.append(f"rank {r} died (exit code {self.procs[r].exitcode}); ")
        return "".join(gone)

    def _exitcode(self, r: int):
        p = self.procs[r]
        p.join(timeout=1.0)
        return p.exitcode

    def _fail(self, job: Job | Call, rank: int, why: str):
        """Restart the pool, then raise JobFailed saying why, with the schedule and plan."""
        try:
            self.restart()
        except RuntimeError as e:  # the next job retries the start
            why += f"\n(and the pool could not restart: {e})"
        raise JobFailed(f"{why}\n{describe(job, rank)}")


def describe(job: Job | Call, rank: int | None = None) -> str:
    """The schedule text and the plan `rank` runs, for a failure message."""
    if isinstance(job, Call):
        return f"--- {job.target} on {job.world} ranks, arguments ---\n{job.args!r}"
    from schedc.compiler import compile_text
    from schedc.lang.diagnostics import CompileError
    from schedc.lang.resolve import Overrides

    try:
        plan = compile_text(job.text, "job.sched", Overrides(steps=job.steps)).plan(rank).render()
    except CompileError as e:
        plan = e.render()
    except Exception as e:  # noqa: BLE001 - a failure report must not fail
        plan = f"(no plan: {type(e).__name__}: {e})"
    fault = f", fault {job.fault!r}" if job.fault else ""
    fault += f", TF32 emulated ({job.tf32})" if job.tf32 else ""
    return (
        f"--- schedule (world {job.world}, {job.steps} step(s), {job.dtype}{fault}) ---\n"
        f"{job.text.strip()}\n--- plan of rank {rank} ---\n{plan}"
    )


def ranks_of(request, world: int):
    """The session's pool that holds `world` ranks: the 4-rank pool, else the 8-rank one."""
    return request.getfixturevalue("pool" if world <= POOL_SIZE else "pool8")


def on_pools(paths) -> list:
    """Schedule files as test parameters, each marked with the pool its world needs
    (`on_pool(4)` or `on_pool(8)`): tests/conftest.py runs each pool's tests on one worker."""
    import pytest

    from schedc.compiler import compile_file

    return [
        pytest.param(
            p, marks=pytest.mark.on_pool(8 if compile_file(p).spec.world > POOL_SIZE else 4)
        )
        for p in paths
    ]

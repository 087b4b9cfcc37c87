"""A pool of real gloo ranks for tests, started once per session.

Four worker processes form one gloo world and, up front, subgroups of sizes 1 to 4.
A job (schedule text, world D, steps, options) goes to ranks 0..D-1, which compile it,
run it with schedc's executor on their subgroup, and send back what rank 0 saw: per-step
loss, grad norm, full gradients (before clipping) and parameters (after the update),
plus every rank's measured memory and communication counts. A job that fails or
outlives its deadline reports its schedule text and plan, and the pool is restarted,
so one broken schedule never hangs the session.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from dataclasses import dataclass, field

POOL_SIZE = 4
JOB_TIMEOUT_S = 120.0


@dataclass
class Job:
    text: str
    world: int
    steps: int = 1
    dtype: str = "float32"
    trace: bool = False
    fault: str | None = None  # a deliberate executor bug (tests of the tests)
    id: int = 0


@dataclass
class JobResult:
    steps: list  # StepStats of rank 0, tensors on CPU
    memory: list[dict] = field(default_factory=list)  # per rank
    comm_bytes: list[dict] = field(default_factory=list)  # per rank, last step
    trace: list[dict] = field(default_factory=list)  # chrome events of every rank


class JobFailed(AssertionError):
    pass


def _worker(rank: int, size: int, store_dir: str, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    groups = {d: dist.new_group(list(range(d))) for d in range(1, size + 1)}
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            break
        try:
            conn.send(("ok", _run_job(job, rank, groups)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which restarts us
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def _run_job(job: Job, rank: int, groups):
    import datetime

    import torch

    from schedc.compiler import compile_text
    from schedc.resolve import Overrides
    from schedc.run import Comm, Executor, RunOptions

    compiled = compile_text(job.text, f"job{job.id}.sched", Overrides(steps=job.steps))
    comm = Comm(rank, job.world, groups[job.world], datetime.timedelta(seconds=JOB_TIMEOUT_S),
                tag=f"job{job.id}")
    opts = RunOptions(device="cpu", dtype=getattr(torch, job.dtype), record=True,
                      trace=job.trace, log=False)
    ex = Executor(compiled, comm, opts)
    if job.fault:
        from tests.faults import inject

        inject(ex, job.fault)
    try:
        stats = [ex.step() for _ in range(job.steps)]
    finally:
        ex.close()
    if rank != 0:
        for s in stats:
            s.grads, s.params = {}, {}
    return {"steps": stats, "memory": ex.memory(), "comm_bytes": stats[-1].comm_bytes,
            "trace": ex.trace_events() if job.trace else []}


class Pool:
    def __init__(self, size: int = POOL_SIZE):
        self.size = size
        self.jobs = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="schedc-pool-")
        self.conns, self.procs = [], []
        for r in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.size, self._dir.name, child),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120) or c.recv() != "ready":
                self.close()
                raise RuntimeError("test worker pool failed to start")

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()

    def restart(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()
        self._dir.cleanup()
        self._start()

    def run(self, text: str, world: int, steps: int = 1, *, dtype: str = "float32",
            trace: bool = False, fault: str | None = None,
            timeout: float = JOB_TIMEOUT_S) -> JobResult:
        assert 1 <= world <= self.size
        self.jobs += 1
        job = Job(text, world, steps, dtype, trace, fault, self.jobs)
        for c in self.conns[:world]:
            c.send(job)
        replies = []
        for r, c in enumerate(self.conns[:world]):
            if not c.poll(timeout):
                self.restart()
                raise JobFailed(f"rank {r} did not finish within {timeout:.0f}s:\n"
                                f"{_describe(job)}")
            replies.append(c.recv())
        errors = [(r, msg) for r, (status, msg) in enumerate(replies) if status != "ok"]
        if errors:
            self.restart()  # the other ranks may be stuck in a collective
            r, tb = errors[0]
            raise JobFailed(f"rank {r} failed:\n{tb}\n{_describe(job)}")
        outs = [msg for _, msg in replies]
        return JobResult(outs[0]["steps"], [o["memory"] for o in outs],
                         [o["comm_bytes"] for o in outs],
                         [e for o in outs for e in o["trace"]])


def _describe(job: Job) -> str:
    from schedc.compiler import compile_text
    from schedc.errors import CompileError

    try:
        plan = compile_text(job.text, "job.sched").plan().render()
    except CompileError as e:
        plan = e.render()
    return f"--- schedule (world {job.world}, {job.steps} steps) ---\n{job.text}\n--- plan ---\n{plan}"

"""Helpers for the GPU tests (tests/exec/test_cuda.py, tests/exec/test_cuda_world.py).

Where they run: on a CUDA device, or, with SCHEDC_GPU_REHEARSAL=1 (scripts/gpu_check.sh
--rehearse, in CI), as CPU twins: the same scripts, processes and tolerance logic on the
CPU with gloo, skipping only what needs a device (the CUDA sanitizer, stream sleeps, the
caching allocator's counters). `DEVICE` is the device they run on; `gpu_or_twin` and
`needs_cuda` are their skip marks. The processes they start get tests/ranks.py's
environment: this checkout first on PYTHONPATH, then whatever it held (on the GPU machine
the site folder its wheels were installed into: lark and graphviz).

`world1_variant` turns any bundled schedule into a small world-1 schedule of the same shape
(its units or buckets, prefetch, no_sync, streams and micro-step count; the nano model with
as many layers, short sequences) for runs under the CUDA sanitizer. It is plain text
arithmetic, tested on CPU (test_hazards.py compiles every bundled schedule's variant).

`run_ranks` runs a schedule on `world` processes that share one GPU: the stream groups use
gloo on CUDA tensors (NCCL refuses two ranks on one device), so the CUDA backend's streams,
events, allocations, bucket division and shard offsets run at world > 1 without eight GPUs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import re
import traceback
from pathlib import Path

import pytest

REHEARSAL = os.environ.get("SCHEDC_GPU_REHEARSAL") == "1"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


DEVICE = "cuda" if _cuda() else "cpu"
gpu_or_twin = pytest.mark.skipif(
    DEVICE != "cuda" and not REHEARSAL,
    reason="needs a CUDA device (SCHEDC_GPU_REHEARSAL=1 runs its CPU twin)",
)
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device, even rehearsed")


def world1_variant(path: Path, max_micro_steps: int = 4) -> str:
    """The schedule at `path` at world 1, nano-sized, with up to `max_micro_steps` micro-steps
    of one sequence of 32 tokens (its own count when smaller)."""
    from schedc.compiler import compile_file

    spec = compile_file(path).spec
    k = min(spec.accum, max_micro_steps)
    text = path.read_text()
    text = re.sub(
        r"(?m)^model\s+\S+(\s*\{[^}]*\})?", f"model nano {{ n_layer = {spec.model.n_layer} }}", text
    )
    text = re.sub(r"(?m)^world\s+\d+", "world 1", text)
    text = re.sub(r"(?m)^mesh\s+.*$", "", text)  # one rank: the flat layout of its strategy
    text = re.sub(r"(?m)^batch\s+\d+\s*x\s*\d+", f"batch {k} x 32", text)
    text = re.sub(r"(?m)^micro\s+\d+", "micro 1", text)
    text = re.sub(r"(?m)^memory\s+.*$", "", text)  # nano's sizes, not the budget's
    text = re.sub(r"(?m)^steps\s+\d+", "steps 2", text)
    # what a run does around the step is not the variant's: its data (shards the recipe
    # names need not exist here) and its evaluations (samples need GPT-2's vocabulary)
    text = re.sub(r"(?m)^data\s+.*$", "data corpus", text)
    return re.sub(r"(?ms)^eval\s*\{.*?^\}", "", text)


def _rank_main(rank, world, text, steps, store_path, opts, q) -> None:
    try:
        import torch
        import torch.distributed as dist

        from schedc.compiler import compile_text
        from schedc.exec.executor import Executor
        from schedc.exec.options import Comm, RunOptions
        from schedc.lang.resolve import Overrides

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=120)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        c = compile_text(text, f"ranks{world}.sched", Overrides(steps=steps))
        ex = Executor(
            c,
            Comm(rank, world, None, timeout),
            RunOptions(device=DEVICE, collectives="gloo", record=True, log=False, **opts),
        )
        stats = [ex.step() for _ in range(steps)]
        for s in stats:
            s.grads = {n: t.cpu() for n, t in s.grads.items()}
            s.params = {n: t.cpu() for n, t in s.params.items()}
        out = {
            "steps": stats,
            "fallbacks": sorted(getattr(ex.backend, "fallbacks", ())),  # CUDA + gloo only
            "memory": ex.memory(),
        }
        ex.close()
        # by value: a tensor sent through the queue as itself is shared memory, which is
        # gone once this process exits, possibly before the parent has read it
        q.put((rank, pickle.dumps(out if rank == 0 else {"fallbacks": out["fallbacks"]})))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


def spawn_ranks(target, world: int, args: tuple, timeout: float = 240) -> dict:
    """Start `world` processes running target(rank, world, *args, queue); each puts
    (rank, result or traceback text). Returns the results by rank, or fails with the first
    traceback."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    got = {r: pickle.loads(v) if isinstance(v, bytes) else v for r, v in got.items()}
    errors = [v for v in got.values() if isinstance(v, str)]
    if errors:
        raise AssertionError("a rank failed:\n" + errors[0])
    return got


def run_ranks(text: str, world: int, steps: int, store_dir: Path, **opts) -> dict:
    """Rank 0's steps (StepStats, tensors on the CPU), and the collectives gloo lacked on
    CUDA (the fallbacks used), from `world` processes on GPU 0 (or the CPU, rehearsed)."""
    store = str(store_dir / f"store{world}")
    got = spawn_ranks(_rank_main, world, (text, steps, store, opts))
    assert len({tuple(v["fallbacks"]) for v in got.values()}) == 1  # every rank agrees
    return got[0]

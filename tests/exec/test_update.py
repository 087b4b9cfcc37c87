"""The update never waits on the host, and a world of one communicates nothing.

A step's host reads of device values (`.item()`, `.tolist()`, `bool()`, `float()` of a
tensor) are counted with a TorchFunctionMode: none may come before the optimizer step is
enqueued. On a GPU each such read is a synchronisation, and one before the update leaves
the device idle while the host issues the clip and AdamW's launches (the GPU check runs
the same step under `torch.cuda.set_sync_debug_mode("error")`). A non-finite step is then
skipped on the device, by fused AdamW's `found_inf`, and still named on the host after it.
"""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from schedc.compiler import compile_text
from schedc.errors import RunError
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions
from schedc.lang.resolve import Overrides
from tests.cuda_ranks import spawn_ranks
from tests.world1 import executor as local_executor

pytestmark = pytest.mark.torch

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"}

DDP = """
model nano
world {world}
batch {seqs} x 32
micro 2
seed 7
ddp {{ bucket b1 = head, h.1  bucket b2 = h.0, embed  no_sync on }}
"""
FSDP = """
model nano
world {world}
batch {seqs} x 32
micro 2
seed 7
fsdp {{ unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head
       prefetch forward 1  prefetch backward 1 }}
"""
SINGLE = """
model nano
world 1
batch 4 x 32
micro 2
seed 7
"""
TEXTS = {"ddp": DDP, "fsdp": FSDP, "single": SINGLE}


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values, and where they fall: before or after the
    optimizer's step was enqueued (`enqueued` is set by a wrapper around it)."""

    def __init__(self):
        super().__init__()
        self.before: list[str] = []
        self.after: list[str] = []
        self.enqueued = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            (self.after if self.enqueued else self.before).append(name)
        return func(*args, **(kwargs or {}))


def count_host_reads(ex: Executor) -> HostReads:
    """One step of `ex` under the counter (the step after a first one, which made AdamW's
    state)."""
    reads = HostReads()
    step = ex.optimizer.step

    def enqueue(*a, **kw):
        out = step(*a, **kw)
        reads.enqueued = True
        return out

    ex.optimizer.step = enqueue
    with reads:
        stats = ex.step()
    ex.optimizer.step = step
    assert stats.issue_ms > 0
    return reads


def executor(text: str, steps: int = 3, **opts) -> Executor:
    return local_executor(text, steps, "update.sched", **opts)


@pytest.mark.parametrize("layout", TEXTS)
def test_a_step_reads_nothing_on_the_host_before_its_update(world1, layout):
    ex = executor(TEXTS[layout].format(world=1, seqs=4))
    ex.step()
    reads = count_host_reads(ex)
    ex.close()
    assert reads.before == [], f"host reads before the update was enqueued: {reads.before}"
    assert sorted(reads.after) == ["item", "item"]  # the loss and the norm, for the log


def _reads_on_ranks(rank, world, text, store, q) -> None:
    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timeout
        )
        c = compile_text(text, "update.sched", Overrides(steps=3))
        ex = Executor(c, Comm(rank, world, None, timeout), RunOptions(device="cpu", log=False))
        ex.step()
        reads = count_host_reads(ex)
        ex.close()
        q.put((rank, {"before": reads.before, "after": sorted(reads.after)}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


@pytest.mark.ranks
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_at_world_2_the_norm_and_loss_are_summed_on_the_device(tmp_path, layout):
    """At world 2 the global norm and loss are all-reduced as tensors: still no host read."""
    text = TEXTS[layout].format(world=2, seqs=8)
    got = spawn_ranks(_reads_on_ranks, 2, (text, str(tmp_path / "store")), timeout=120)
    assert got == {r: {"before": [], "after": ["item", "item"]} for r in range(2)}


def test_a_nonfinite_step_is_skipped_on_the_device_and_named_after_it(world1):
    """The poisoned step leaves parameters, moments and AdamW's step count as they were;
    with --nonfinite stop the step fails naming it, after the update was enqueued."""
    for mode in ("skip", "stop"):
        ex = executor(FSDP.format(world=1, seqs=4), nonfinite=mode)
        ex.step()
        before = [u.shard.clone() for u in ex.units.values()]
        state = {
            id(p): {k: v.clone() for k, v in st.items()} for p, st in ex.optimizer.state.items()
        }
        u = next(iter(ex.units.values()))
        fold = u.take_grad

        def poisoned(key, fold=fold):
            g = fold(key)
            g[0] = float("nan")
            return g

        u.take_grad = poisoned
        if mode == "skip":
            stats = ex.step()
            assert "step 1: the gradient norm is nan" in stats.skipped
        else:
            with pytest.raises(
                RunError, match="step 1: the gradient norm is nan.*--nonfinite skip"
            ):
                ex.step()
        assert all(torch.equal(a, u.shard) for a, u in zip(before, ex.units.values()))
        for p, st in ex.optimizer.state.items():
            for k, v in st.items():
                assert torch.equal(v, state[id(p)][k]), (mode, k)
        ex.close()


class _Group:
    """A process group that records which of its collectives are called."""

    def __init__(self, pg, called: list[str]):
        self._pg, self._called = pg, called

    def __getattr__(self, name):
        if name in ("allreduce", "_allgather_base", "_reduce_scatter_base", "allgather"):
            self._called.append(name)
        return getattr(self._pg, name)


def test_a_world_of_one_issues_no_collective(world1):
    """At world 1 a gather is a cast and a reduce-scatter a copy: no group's collective is
    called in a step, and the steps still equal the reference under the policy."""
    from types import SimpleNamespace

    from tests.oracle import assert_matches, reference_steps

    text = FSDP.format(world=1, seqs=4) + "precision bf16\n"
    ex = executor(text, steps=2, record=True)
    called: list[str] = []
    collective = ex.backend.collective

    def spied(stream, op, launch, done, dim=None):
        return collective(stream, op, lambda pg: launch(_Group(pg, called)), done, dim)

    ex.backend.collective = spied
    got = [ex.step() for _ in range(2)]
    ex.close()
    assert called == []
    assert_matches(SimpleNamespace(steps=got), reference_steps(text, 2))

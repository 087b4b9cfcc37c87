"""Issue 20's stream and allocator hazards, tested without a GPU.

The CUDA tests in test_cuda_world.py run the same code on a device; these prove the
bookkeeping on CPU, where it runs unchanged:

- a gathered unit's storage is given back only after the stream that allocated it has waited
  for the free's mark (the consumer's event), never at the free itself (hazard 2);
- the stream groups are created with local synchronization, so schedc's ranks can be a
  subgroup of a larger job whose other ranks never call new_group for them (hazard 4);
- missing AdamW moments are made on their parameter's device and dtype, and a resume puts
  every moment there (hazard 5).

Hazard 1 (every step begins with the comm streams waiting on compute) is a property of the
lowered plan: tests/passes/test_lower.py.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from schedc.compiler import compile_file, compile_text
from schedc.exec.checkpoint import store
from schedc.exec.checkpoint.state import unit_moment
from schedc.exec.executor import Executor
from schedc.exec.options import Comm, RunOptions
from schedc.ir.op import COMPUTE, Kind
from schedc.lang.resolve import Overrides
from schedc.lang.resources import bundled_schedules
from tests.cuda_ranks import spawn_ranks
from tests.exec.test_cuda import FSDP
from tests.world1 import executor as local_executor


def executor(text: str = FSDP, steps: int = 2, **opts) -> Executor:
    return local_executor(text, steps, "hazards.sched", **opts)


# -- hazard 2: gathered storage released after its consumer's event ------------------------------


def test_gathered_storage_is_released_only_after_its_allocating_stream_waited_for_the_free(
    world1,
):
    """Every free leaves the unit's storage in place and marks compute; the storage goes to
    zero bytes only after the stream whose gather allocated it waited for that very mark,
    and no later than that stream's next gather (or the step's end)."""
    ex = executor()
    log: list[tuple] = []
    mark, wait_mark, run_op = ex.backend.mark, ex.backend.wait_mark, ex.run_op

    def logged_mark(stream):
        m = mark(stream)
        log.append(("mark", stream, m))
        return m

    def logged_wait(stream, m):
        log.append(("wait", stream, m))
        wait_mark(stream, m)

    def logged_run(stream, op, *rest):
        run_op(stream, op, *rest)
        if op.kind in (Kind.FREE, Kind.ALLGATHER):
            u = ex.units[op.target]
            log.append((op.kind, stream, op, u.full.untyped_storage().nbytes()))

    ex.backend.mark, ex.backend.wait_mark, ex.run_op = logged_mark, logged_wait, logged_run
    for u in ex.units.values():
        release = u.release

        def logged_release(u=u, release=release):
            log.append(("release", u.name, u.full.untyped_storage().nbytes()))
            release()

        u.release = logged_release
    for _ in range(2):
        ex.step()
    frees = [k for k, e in enumerate(log) if e[0] is Kind.FREE]
    assert frees, "the schedule frees units"
    for k in frees:
        _, stream, op, nbytes = log[k]
        unit = ex.units[op.target]
        assert stream == COMPUTE and nbytes == unit.full_bytes, f"{op} released at the free"
        # the free's own mark, on compute, right before it returned
        kind, mstream, m = log[k - 1]
        assert (kind, mstream) == ("mark", COMPUTE)
        # then: its release, preceded by the comm stream's wait for that mark
        rel = next(j for j in range(k + 1, len(log)) if log[j][:2] == ("release", op.target))
        waits = [e for e in log[k + 1 : rel] if e[0] == "wait" and e[2] is m]
        assert waits and waits[0][1] != COMPUTE, f"{op}'s storage given back without a wait"
        assert log[rel][2] == unit.full_bytes  # still held until that moment
        # and no gather on that stream was issued in between (it could not reuse the block)
        between = [e for e in log[k + 1 : rel] if e[0] is Kind.ALLGATHER and e[1] == waits[0][1]]
        assert not between, f"{op}: {between[0][2]} was gathered while the storage was held"
    assert not ex.pending_frees  # each step gives back every free's storage
    ex.close()


def test_the_released_storage_bounds_memory_by_the_prediction(world1):
    """Held storage counts as gathered: the measured peak stays the compiler's prediction."""
    ex = executor()
    for _ in range(2):
        ex.step()
    predicted = ex.compiled.memory.gathered_peak
    assert 0 < ex.memory()["gathered_peak"] <= predicted * 1.10
    ex.close()


# -- hazard 4: stream groups inside a larger world -----------------------------------------------


def _subgroup_worker(rank: int, world: int, store_path: str, q) -> None:  # spawn_ranks
    try:
        from schedc.exec.backends import stream_groups

        timeout = datetime.timedelta(seconds=30)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        # two schedc jobs of two ranks each inside a world of four: every rank creates both
        # job groups (the usual new_group contract), then each job creates its own stream
        # groups, called by its members only
        jobs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = jobs[rank // 2]
        comm = Comm(dist.get_rank(mine), 2, mine, timeout)
        streams = ("compute", "comm", "comm2") if rank < 2 else ("compute", "comm")
        groups = stream_groups(streams, comm, "gloo")
        sums = {}
        for s, pg in groups.items():
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=pg)
            sums[s] = t.item()
        q.put((rank, sums))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


@pytest.mark.ranks
def test_stream_groups_are_created_by_their_members_only(tmp_path):
    """Ranks 0-1 and 2-3 run different schedc jobs (three and two streams) in one world of
    four. Without local synchronization the first new_group would wait for all four ranks
    and time out; with it, every stream group forms and sums over its own two ranks."""
    got = spawn_ranks(_subgroup_worker, 4, (str(tmp_path / "store"),), timeout=120)
    for rank, sums in got.items():
        expect = 1.0 + 2.0 if rank < 2 else 3.0 + 4.0
        assert set(sums) == ({"compute", "comm", "comm2"} if rank < 2 else {"compute", "comm"})
        assert all(v == expect for v in sums.values()), (rank, sums)


# -- hazard 5: AdamW moments on the parameter's device -------------------------------------------


def test_missing_moments_are_made_on_the_parameters_device_and_dtype():
    """The template a resume loads into: zeros where AdamW has no state yet, made like the
    parameter (the meta device stands in for CUDA: zeros made without it land on the CPU)."""
    params = [nn.Parameter(torch.empty(5, device="meta", dtype=torch.float64)) for _ in range(2)]
    opt = torch.optim.AdamW(params)
    local = torch.empty(10, device="meta", dtype=torch.float64)
    for key in ("exp_avg", "exp_avg_sq"):
        m = unit_moment(opt, params, key, local)
        assert m.device == params[0].device and m.dtype == params[0].dtype
        assert m.shape == (10,)
    assert unit_moment(opt, [], "exp_avg", local).device.type == "meta"


def test_a_resumed_fsdp_run_has_its_moments_on_the_parameters_device(world1, tmp_path):
    """Saved before any update (no moments: the zeros template) and after one; resumed, every
    AdamW moment sits beside its parameter, in its dtype, and the next step runs."""
    ex = executor(steps=3, dtype=torch.float64)
    store.save(ex, tmp_path / "s0")
    ex.step()
    store.save(ex, tmp_path / "s1")
    ex.close()
    for where, step in (("s0", 0), ("s1", 1)):
        again = executor(steps=3, dtype=torch.float64)
        assert store.load(again, tmp_path / where) == step
        for p, st in again.optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert st[key].device == p.device and st[key].dtype == p.dtype
        assert len(again.optimizer.state) == (0 if step == 0 else len(list(_opt_params(again))))
        again.step()
        again.close()


def _opt_params(ex):
    for u in ex.units.values():
        for group in u.optimizer_params():
            yield from group


def test_environment_for_nccl_launch_order(monkeypatch):
    """Hazard 3: more than one collective stream orders NCCL launches by host order; one
    does not touch the environment; a value the user set wins."""
    from schedc.exec.backends import LAUNCH_ORDER, nccl_launch_order

    monkeypatch.delenv(LAUNCH_ORDER, raising=False)
    assert not nccl_launch_order(1) and LAUNCH_ORDER not in os.environ
    assert nccl_launch_order(2) and os.environ[LAUNCH_ORDER] == "1"
    monkeypatch.setenv(LAUNCH_ORDER, "0")
    assert not nccl_launch_order(3) and os.environ[LAUNCH_ORDER] == "0"


TWO_STREAMS = FSDP + "stream reducescatter = rs\n"


def test_a_schedule_with_two_collective_streams_asks_for_launch_order():
    """FSDP2's layout (gathers on one stream, reduce-scatters on another): two communicators
    in flight, so train.py sets the launch order before NCCL starts; and the plan's step
    start makes both streams wait on compute."""
    from schedc.exec.executor import collective_streams

    plan = compile_text(TWO_STREAMS, "two.sched").plan()
    assert collective_streams(plan) == {"comm", "rs"}
    heads = [i for i in plan.instrs[1:3]]
    assert {(i.stream, i.event) for i in heads} == {
        ("comm", plan.step_start),
        ("rs", plan.step_start),
    }


def test_two_collective_streams_run_and_give_back_storage(world1):
    """The deferred release with two comm streams (gathers on comm, reduce-scatters on rs):
    every step gives every held storage back, and the gradients match one stream's run."""
    one, two = executor(record=True), executor(TWO_STREAMS, record=True)
    for _ in range(2):
        a, b = one.step(), two.step()
        assert not two.pending_frees
        for n in a.grads:
            assert torch.equal(a.grads[n], b.grads[n]), n
    one.close()
    two.close()


# -- what the GPU tests build on, checked here ---------------------------------------------------


@pytest.mark.parametrize("path", bundled_schedules(), ids=lambda p: p.name)
def test_every_bundled_schedule_has_a_world1_variant_of_its_shape(world1, path, monkeypatch):
    """The sanitizer runs these on a GPU: each compiles, keeps its strategy, layers and
    streams, and runs a step on CPU equal to the single-process reference. A `compile on`
    variant compiles with dynamo's eager backend here (the same regions and cut: 80 s of
    inductor on this CPU otherwise; tests/exec/test_compile.py runs inductor itself)."""
    monkeypatch.setenv("SCHEDC_COMPILE_BACKEND", "eager")
    from tests.cuda_ranks import world1_variant
    from tests.oracle import reference_steps

    original = compile_file(path).spec
    text = world1_variant(path)
    c = compile_text(text, path.name, Overrides(steps=1))
    assert c.spec.world == 1 and c.spec.kind is original.kind
    assert c.spec.model.n_layer == original.model.n_layer
    assert set(c.plan().streams) <= set(original.stream_names())
    ex = Executor(c, Comm(0, 1, tag=f"variant{path.name}"), RunOptions(device="cpu", log=False))
    got = ex.step()
    ex.close()
    assert abs(got.loss - reference_steps(text, 1)[0].loss) <= 1e-5 * abs(got.loss)


def test_the_drop_gather_wait_fault_removes_one_wait_for_a_gather(world1):
    from schedc.ir.plan import Action
    from tests.faults import inject

    ex = executor()
    before = ex.plan
    inject(ex, "drop-gather-wait")
    (gone,) = [i for i in before.instrs if i not in ex.plan.instrs or before.instrs.count(i) > 1]
    assert gone.kind is Action.WAIT and gone.stream == COMPUTE
    assert before.producers[gone.event].kind is Kind.ALLGATHER
    assert len(ex.plan.instrs) == len(before.instrs) - 1
    ex.close()

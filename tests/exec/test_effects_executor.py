"""The executor allocates and frees what the plan's lifetimes say, where they say it.

`ir/effects.py` `lifetimes` is the one statement of when each buffer lives; the memory
ledger adds its bytes up (passes/memory.py). Here real ranks run schedules with
`RunOptions(log_buffers=True)`: the executor logs every buffer it allocates or frees by its
effects name (FSDP's gathered units, unsharded gradients and accumulators, gradient shards,
and what a reduce-scatter holds until it is retired), at the instruction it runs. Every
rank's log of a step must equal its plan's lifetimes, instruction by instruction: a fused
run of compute ops is one item, so its instructions' buffers are attributed to its first
(exec/fuse.py; fusion is off under --trace, which the trace case checks op by op).
Activations are not buffers of the executor's (autograd saves them); the heap tests hold
them against the ledger (test_memory_measured.py).

Every bundled schedule (at its own world, its HSDP mesh included, when the pool has the
ranks; else at the world-1 variant of its shape), and 30 generated ones: DDP and FSDP at
worlds 1-4, every precision policy, recompute, no_sync's upcast, HSDP meshes, the chunked
loss.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.compiler import compile_text
from schedc.exec.fuse import Segment, fuse
from schedc.ir.effects import Alloc, Free, Part, lifetimes
from schedc.lang.resolve import Overrides
from schedc.lang.resources import bundled_schedules
from tests.cuda_ranks import world1_variant
from tests.exec.test_hsdp import pool6  # noqa: F401 - the six-rank pool, a fixture
from tests.strategies import PRECISIONS, cases, hsdp_cases

JOB_S = 60
STEPS = 1


def expected(text: str, rank: int, fused: bool) -> Counter:
    """(item, action, buffer) of one step of `rank`'s plan, from its lifetimes."""
    c = compile_text(text, "e.sched", Overrides(steps=STEPS))
    plan = c.plan(rank)
    item = {}
    for it in fuse(plan, c.spec.model, enabled=fused):
        if isinstance(it, Segment):
            ops = set(it.ops)
            item |= {k: it.first for k, ins in enumerate(plan.instrs) if ins.op in ops}
        else:
            item[it] = it
    out: Counter = Counter()
    for k, steps in enumerate(lifetimes(c.spec, plan).steps):
        for s in steps:
            if isinstance(s, Alloc) and s.part is not Part.ACTS:
                out[(item[k], "alloc", s.buffer)] += 1
            elif isinstance(s, Free) and not s.buffer.startswith("act["):
                out[(item[k], "free", s.buffer)] += 1
    return out


def logged(log: list, step: int) -> Counter:
    """The executor's (instruction, action, buffer) of one step (a hold is an allocation
    the collective keeps, a release its end)."""
    verb = {"alloc": "alloc", "hold": "alloc", "free": "free", "release": "free"}
    return Counter((k, verb[a], b) for s, k, a, b in log if s == step)


def check(pool, text: str, world: int, trace: bool = False) -> int:
    """Run `text` one step; every rank must log exactly its lifetimes. Returns how
    many buffer events were compared."""
    got = pool.run(text, world, STEPS, log_buffers=True, trace=trace, timeout=JOB_S)
    n = 0
    for rank, log in enumerate(got.buffer_log):
        want = expected(text, rank, fused=not trace)
        have = logged(log, STEPS - 1)
        assert have == want, (
            f"rank {rank}: the executor only {sorted((have - want).elements(), key=str)[:8]}; "
            f"the lifetimes only {sorted((want - have).elements(), key=str)[:8]}\n{text}"
        )
        n += sum(want.values())
    return n


def at_its_world(path, size: int) -> tuple[str, int]:
    """The schedule at its own world (else its world-1 variant), eager: compiled regions
    change the kernels a layer runs, not the buffers the plan allocates and frees
    (tests/exec/test_compile.py runs them), and a first inductor compile in a pool worker
    takes longer than a job's deadline under load."""
    c = compile_text(path.read_text(), path.name)
    if c.spec.world <= size and c.spec.model.numel < 3_000_000:
        text, world = path.read_text().replace("\nsteps ", "\n# steps "), c.spec.world
    else:
        text, world = world1_variant(path), 1
    return re.sub(r"(?m)^compile\s+on\b", "compile off", text), world


@pytest.mark.parametrize("path", bundled_schedules(), ids=lambda p: p.stem)
def test_every_bundled_schedule_frees_what_its_lifetimes_say(pool6, path):  # noqa: F811
    text, world = at_its_world(path, 6)
    check(pool6, text, world)


def test_with_every_op_on_its_own_the_log_matches_op_by_op(pool6):  # noqa: F811
    path = next(p for p in bundled_schedules() if p.stem == "tiny_fsdp_prefetch")
    assert check(pool6, *at_its_world(path, 6), trace=True) > 50


CHUNK = "loss chunk 8"


@st.composite
def generated(draw):
    case = draw(
        st.one_of(
            cases(kinds=("ddp", "fsdp"), max_k=3, precisions=tuple(PRECISIONS)),
            hsdp_cases(max_k=2),
        )
    )
    if draw(st.booleans()):
        case = case.with_(extra=(CHUNK,))
    return case


@settings(max_examples=30)
@given(case=generated())
def test_generated_schedules_free_what_their_lifetimes_say(pool6, case):  # noqa: F811
    check(pool6, case.text(), case.world)

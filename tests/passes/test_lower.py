"""Lowered plans: golden files, the program round trip, and the CUDA lowering's promises.

Golden files under tests/golden/ hold `--dump plan` and `--dump program` of every bundled
schedule; a change shows as a diff. Regenerate them on purpose with

    SCHEDC_REGEN=1 python -m pytest tests/passes/test_lower.py

The lowering properties are checked without a GPU, by reading the plan as a CUDA runtime
would: a `record` follows its producer on the producer's stream, a `wait` precedes its
consumer on the consumer's stream, and every need of the graph is met by stream order or
by a chain of events (an independent replay of the plan, not the compiler's own clocks).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from schedc.compiler import Compiled, compile_file, compile_text
from schedc.ir.op import COMM, COMPUTE, STEP, Kind, Op, Phase, bwd, fwd
from schedc.ir.plan import Action, Instr, Plan
from schedc.lang.resources import bundled_schedules
from tests.goldens import GOLDEN, REPO, assert_golden

NAMES = [p.name for p in bundled_schedules()]

_compiled: dict[str, Compiled] = {}


def compiled(name: str) -> Compiled:
    if name not in _compiled:
        _compiled[name] = compile_file(REPO / "schedules" / name)
    return _compiled[name]


# -- golden files --------------------------------------------------------------------------------


@pytest.mark.parametrize("dump", ["plan", "program"])
@pytest.mark.parametrize("name", NAMES)
def test_golden(name, dump):
    c = compiled(name)
    text = c.dump("plan") if dump == "plan" else c.dump("program")
    assert_golden(GOLDEN / f"{name.removesuffix('.sched')}.{dump}", text.rstrip("\n") + "\n")


def test_no_stale_golden_files():
    expected = {f"{n.removesuffix('.sched')}.{d}" for n in NAMES for d in ("plan", "program")}
    assert {p.name for p in GOLDEN.glob("*.plan")} | {
        p.name for p in GOLDEN.glob("*.program")
    } == expected


# -- the program round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_dumped_programs_compile_back_to_the_same_plan(name):
    c = compiled(name)
    text = c.source.text + "\n" + c.dump("program") + "\n"
    again = compile_text(text, f"roundtrip-{name}")
    assert again.graph().written == set(c.plan().streams)  # every stream is now written
    assert again.plan().instrs == c.plan().instrs
    assert again.dump("plan") == c.dump("plan")
    assert again.dump("program") == c.dump("program")


# -- what CUDA streams and events promise --------------------------------------------------------


def replay(plan: Plan) -> tuple[dict[Op, dict[str, int]], dict[Op, tuple[str, int]]]:
    """Run the plan as streams and events would: for each op, what is known complete when it
    starts (per stream: the last position), and where each op runs (stream, position)."""
    at: dict[Op, tuple[str, int]] = {}
    known: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(lambda: -1))
    recorded: dict[int, dict[str, int]] = {}
    started: dict[Op, dict[str, int]] = {}
    count: dict[str, int] = defaultdict(int)
    for ins in plan.instrs:
        s = ins.stream
        if ins.kind is Action.RUN:
            started[ins.op] = dict(known[s])
            at[ins.op] = (s, count[s])
            known[s][s] = count[s]  # work on a stream completes in order
            count[s] += 1
        elif ins.kind is Action.RECORD:
            recorded[ins.event] = dict(known[s])
        else:
            assert ins.event in recorded, f"wait for e{ins.event} before it is recorded"
            for t, pos in recorded[ins.event].items():
                known[s][t] = max(known[s][t], pos)
    return started, at


def before(started, at, u: Op, v: Op) -> bool:
    """u is complete before v starts."""
    (su, pu), (sv, pv) = at[u], at[v]
    return pu < pv if su == sv else started[v].get(su, -1) >= pu


@pytest.mark.parametrize("name", NAMES)
def test_every_event_is_recorded_after_its_producer_and_waited_before_its_consumer(name):
    c = compiled(name)
    g, plan = c.graph(), c.plan()
    instrs = list(plan.instrs)
    run_at = {ins.op: k for k, ins in enumerate(instrs) if ins.kind is Action.RUN}
    record_at = {ins.event: k for k, ins in enumerate(instrs) if ins.kind is Action.RECORD}
    waits = defaultdict(list)  # op -> events its stream waits for just before it
    for k, ins in enumerate(instrs):
        if ins.kind is Action.RUN:
            j = k - 1
            while j >= 0 and instrs[j].kind is Action.WAIT and instrs[j].stream == ins.stream:
                if instrs[j].event != plan.step_start:  # tested on its own below
                    waits[ins.op].append(instrs[j].event)
                j -= 1
    events = g.events()
    assert len(plan.producers) == len({u for u, _ in events})
    for u, v in events:
        su, sv = g.stream_of(u), g.stream_of(v)
        assert su != sv, f"{u} -> {v} is an event on one stream"
        e = next(e for e, op in plan.producers.items() if op == u)
        assert instrs[record_at[e]].stream == su
        assert record_at[e] == run_at[u] + 1  # recorded right after the producer
        assert e in waits[v], f"{v} does not wait for e{e} ({u})"
        assert v in plan.consumers[e]
    # and nothing else: every wait belongs to an event edge
    assert sum(len(w) for w in waits.values()) == len(events)


@pytest.mark.parametrize("name", NAMES)
def test_every_need_holds_in_the_replayed_plan(name):
    c = compiled(name)
    for rank, plan in c.plans.items():
        started, at = replay(plan)
        g = c.graph(rank)
        assert set(at) == set(g.placed())
        for u, v, whys in g.needs():
            assert before(started, at, u, v), f"{v} can start before {u} ({', '.join(whys)})"


def _two_steps(plan: Plan) -> tuple[tuple[Instr, ...], list[Op]]:
    """The plan issued twice, as the executor does step after step: the second copy's events
    renumbered and its ops moved to micro-steps 1000+ so both steps' ops are distinct.
    Returns the instructions and the second step's ops."""
    shift = max([*plan.producers, plan.step_start or 0]) + 1
    second = tuple(
        dataclasses.replace(
            i,
            op=i.op._replace(mb=i.op.mb + 1000) if i.op is not None else None,
            event=i.event + shift if i.event is not None else None,
        )
        for i in plan.instrs
    )
    return plan.instrs + second, [i.op for i in second if i.op is not None]


@pytest.mark.parametrize("name", NAMES)
def test_every_step_begins_with_the_comm_streams_waiting_on_compute(name):
    """Issue 20, hazard 1: a step's first collectives read what the previous step's optimizer
    wrote on compute, so every comm stream waits, before its first work, for the step start:
    an event recorded on compute before anything else. Replayed over two steps, every op of
    the second step starts after the first step's update, on every stream."""
    c = compiled(name)
    for plan in c.plans.values():
        comm = [s for s in plan.streams if s != COMPUTE]
        if not comm:
            assert plan.step_start is None
            continue
        n = len(comm)
        assert plan.instrs[0] == Instr(Action.RECORD, COMPUTE, event=plan.step_start)
        assert list(plan.instrs[1 : 1 + n]) == [
            Instr(Action.WAIT, s, event=plan.step_start) for s in comm
        ]
        assert plan.instrs[1 + n].kind is Action.RUN
        assert plan.step_start not in plan.producers
        instrs, second = _two_steps(plan)
        started, at = replay(dataclasses.replace(plan, instrs=instrs))
        for op in second:
            assert before(started, at, STEP, op), f"the next step's {op} can overtake the update"


def test_without_the_step_start_the_next_step_overtakes_the_update():
    """The replay above sees the hazard when the step start is taken out of the plan."""
    plan = compiled("fsdp_prefetch.sched").plan()
    bare = tuple(i for i in plan.instrs if i.kind is Action.RUN or i.event != plan.step_start)
    broken = dataclasses.replace(plan, instrs=bare, step_start=None)
    instrs, second = _two_steps(broken)
    started, at = replay(dataclasses.replace(broken, instrs=instrs))
    gather = next(op for op in second if op.kind is Kind.ALLGATHER)  # its first collective
    assert not before(started, at, STEP, gather)


def test_the_replay_sees_a_missing_wait():
    """The replay is strict enough to catch a plan that forgot a wait."""
    plan = compiled("ddp_overlap.sched").plan()
    b1 = Op(Kind.ALLREDUCE, "b1", 3)
    started, at = replay(plan)
    assert before(started, at, bwd("h.2", 3), b1)
    e = next(e for e, op in plan.producers.items() if op == bwd("h.2", 3))
    broken = Plan(
        plan.rank,
        plan.streams,
        tuple(i for i in plan.instrs if not (i.kind is Action.WAIT and i.event == e)),
        plan.producers,
        plan.consumers,
    )
    started, at = replay(broken)
    assert not before(started, at, bwd("h.2", 3), b1)


@pytest.mark.parametrize("name", NAMES)
def test_compute_on_compute_collectives_on_comm(name):
    plan = compiled(name).plan()
    for ins in plan.instrs:
        if ins.kind is Action.RUN:
            assert ins.stream == (COMM if ins.op.is_collective else COMPUTE), str(ins)
    assert plan.ops[-1] == STEP


def test_overlap_off_runs_all_reduce_on_the_compute_stream():
    text = (
        (REPO / "schedules/tiny_ddp_overlap.sched").read_text().replace("overlap on", "overlap off")
    )
    plan = compile_text(text, "off.sched").plan()
    assert plan.streams == (COMPUTE,) and not plan.producers
    assert [str(op) for op in plan.collectives(COMPUTE)] == [
        "allreduce[b1]@mb3",
        "allreduce[b2]@mb3",
    ]


# -- seed 003: DDP, bucketed all-reduce overlapped with backward ----------------------------------


def test_seed_003_ddp_overlap():
    c = compiled("ddp_overlap.sched")
    plan = c.plan()
    b1, b2 = Op(Kind.ALLREDUCE, "b1", 3), Op(Kind.ALLREDUCE, "b2", 3)
    assert plan.collectives(COMM) == [b1, b2]  # no_sync: only the last micro-step reduces
    order = {op: i for i, op in enumerate(plan.ops)}
    # b1 (head, h.3, h.2) launches once bwd h.2 is done, while bwd h.1 and h.0 compute
    assert order[bwd("h.2", 3)] < order[b1] < order[bwd("h.1", 3)]
    # b2 holds embed and with it the tied weight: complete only after bwd[embed]
    assert order[bwd("embed", 3)] < order[b2] < order[STEP]
    started, at = replay(plan)
    assert before(started, at, bwd("h.2", 3), b1) and not before(started, at, b1, bwd("h.1", 3))
    assert before(started, at, bwd("embed", 3), b2)
    # the optimizer waits for b2's event (and so, by stream order, for b1)
    e2 = next(e for e, op in plan.producers.items() if op == b2)
    assert STEP in plan.consumers[e2]
    assert before(started, at, b1, STEP) and before(started, at, b2, STEP)
    # the first three micro-steps only accumulate
    assert all(op.kind in (Kind.FWD, Kind.BWD) for op in plan.ops[: order[fwd("embed", 3)]])


# -- seed 004: FSDP, all-gather, compute, free, with prefetch -------------------------------------


def ag(unit: str, phase: Phase) -> Op:
    return Op(Kind.ALLGATHER, unit, 0, phase)


def rs(unit: str) -> Op:
    return Op(Kind.REDUCESCATTER, unit, 0)


def free(unit: str, phase: Phase) -> Op:
    return Op(Kind.FREE, unit, 0, phase)


FSDP_UNITS = ("u1", "u2", "u3")
FIRST_LAYER = {"u1": "embed", "u2": "h.2", "u3": "h.4"}  # embed reads u1's wpe.weight


def test_seed_004_fsdp_backward_reads_like_the_picture():
    plan = compiled("fsdp_prefetch.sched").plan()
    comm = plan.collectives(COMM)
    backward = comm[comm.index(ag("u3", Phase.BWD)) :]
    # AG U3, AG U2, RS U3, AG U1, RS U2, ..., RS U1 (the tied weight reduces with u1's end)
    assert backward == [
        ag("u3", Phase.BWD),
        ag("u2", Phase.BWD),
        rs("u3"),
        ag("u1", Phase.BWD),
        rs("u2"),
        rs("tied"),
        rs("u1"),
    ]
    # per unit per step: 1 all-gather (fwd) + 1 all-gather (bwd) + 1 reduce-scatter
    for u in FSDP_UNITS:
        assert [op.kind for op in comm if op.target == u] == [
            Kind.ALLGATHER,
            Kind.ALLGATHER,
            Kind.REDUCESCATTER,
        ]


def test_seed_004_fsdp_forward_prefetches_the_next_unit():
    plan = compiled("fsdp_prefetch.sched").plan()
    order = {op: i for i, op in enumerate(plan.ops)}
    started, at = replay(plan)
    for cur, nxt in zip(FSDP_UNITS, FSDP_UNITS[1:]):
        # AG of the next unit is issued before the current unit's forward starts...
        assert order[ag(nxt, Phase.FWD)] < order[fwd(FIRST_LAYER[cur], 0)]
        # ...and nothing makes that forward wait for it
        assert not before(started, at, ag(nxt, Phase.FWD), fwd(FIRST_LAYER[cur], 0))
    # each unit is freed right after its forward; a gather waits for the window (depth 1)
    assert before(started, at, free("u1", Phase.FWD), ag("u3", Phase.FWD))


def test_without_forward_prefetch_each_gather_waits_for_the_previous_free():
    text = (REPO / "schedules/fsdp_prefetch.sched").read_text()
    assert "prefetch forward 1" in text
    plan = compile_text(
        text.replace("prefetch forward 1", "prefetch forward 0"), "no-prefetch.sched"
    ).plan()
    order = {op: i for i, op in enumerate(plan.ops)}
    started, at = replay(plan)
    for prev, u in zip(FSDP_UNITS, FSDP_UNITS[1:]):
        assert order[free(prev, Phase.FWD)] < order[ag(u, Phase.FWD)]
        assert before(started, at, free(prev, Phase.FWD), ag(u, Phase.FWD))
        # the exposed all-gather: the unit's forward waits for its own gather
        assert order[ag(u, Phase.FWD)] < order[fwd(FIRST_LAYER[u], 0)]


def test_tiny_fsdp_matches_the_picture_too():
    plan = compiled("tiny_fsdp_prefetch.sched").plan()
    comm = plan.collectives(COMM)
    last = [op for op in comm if op.mb == 1]
    backward = last[last.index(Op(Kind.ALLGATHER, "u3", 1, Phase.BWD)) :]
    assert [(op.kind.value, op.target) for op in backward] == [
        ("allgather", "u3"),
        ("allgather", "u2"),
        ("reducescatter", "u3"),
        ("allgather", "u1"),
        ("reducescatter", "u2"),
        ("reducescatter", "tied"),
        ("reducescatter", "u1"),
    ]

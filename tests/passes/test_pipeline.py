"""Pipeline programs (#31): generated schedules prove clean and time to the textbook bubble;
the hang classes are rejected with their codes; the proof agrees with an independent
step-by-step blocking interpreter on mutated programs. torch-free."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.ir.op import Kind, Op, stage_op
from schedc.ir.pipeline import Pipeline, Placement, Programs, actions, format_program, parse_program
from schedc.lang.diagnostics import CompileError
from schedc.passes.pipeline_check import prove
from schedc.passes.pipeline_gen import Request, Schedule, generate, request_errors
from schedc.passes.pipeline_sim import Costs, Waits, simulate
from tests.pipeline_torch_text import programs_from_torch

S = Schedule
CASES = [(s, p, m, v) for p in (2, 3, 4) for m in range(p, 3 * p + 2)
         for s, v in ((S.GPIPE, 1), (S.ONE_F_ONE_B, 1), (S.ZB_H1, 1), (S.INTERLEAVED, 2),
                      (S.INTERLEAVED, 3), (S.ZB_V, 2))
         if not request_errors(Request(s, p, m, v))]  # fmt: skip
# ZB-V takes any m (its order drops the micro-batches past m): every m from 1, pp 2-5
ZB_V = [(p, m) for p in (2, 3, 4, 5) for m in range(1, 3 * p + 2)]


def test_text_round_trips():
    g = generate(Request(S.INTERLEAVED, 2, 4, 2))
    for prog in g.programs.values():
        assert parse_program(format_program(prog)) == prog
    a = stage_op(Kind.SEND_F, 0, 3, "c1")
    assert str(a) == "SEND_F[s0]@mb3:c1" and Op.parse(str(a)) == a
    with pytest.raises(ValueError):
        Op.parse("F[s0]@mb0:c1")


def test_v_placement():
    pipe = Pipeline(2, 4, 2, Placement.V)
    assert [pipe.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    assert pipe.local(1, 2) and not pipe.local(0, 1)


@pytest.mark.parametrize("sched,p,m,v", CASES)
def test_every_generated_schedule_proves(sched, p, m, v):
    g = generate(Request(sched, p, m, v))
    proof = prove(g.pipeline, g.programs)
    assert proof.ok, [f.render(g.programs) for f in proof.findings]
    assert interpret(g.pipeline, g.programs) == "ok"


@pytest.mark.parametrize("sched", [S.GPIPE, S.ONE_F_ONE_B])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 13)])
def test_gpipe_and_1f1b_bubble_is_textbook(sched, p, m):
    """F = 1, B = 2, latency 0: every rank idles (p-1)/(m+p-1) of the step."""
    g = generate(Request(sched, p, m))
    timing = simulate(prove(g.pipeline, g.programs).graph, Costs(f=1, b=2))
    assert timing.step == 3 * (m + p - 1)
    for b in timing.bubble.values():
        assert b == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (3, 3), (3, 9), (4, 4), (4, 12)])
def test_zb_h1_bubble(p, m):
    """F = I = W = 1: the bubble is (p-1) units of a 3m + p - 1 step, a third of 1F1B's
    (p-1)(F+B) at B = I + W."""
    g = generate(Request(S.ZB_H1, p, m))
    timing = simulate(prove(g.pipeline, g.programs).graph, Costs(f=1, i=1, w=1))
    assert timing.step == 3 * m + p - 1
    assert all(b == pytest.approx((p - 1) / (3 * m + p - 1)) for b in timing.bubble.values())


@pytest.mark.parametrize("p,m", ZB_V)
def test_every_zb_v_schedule_proves_in_a_v(p, m):
    g = generate(Request(S.ZB_V, p, m, 2))
    assert g.pipeline.placement is Placement.V and g.pipeline.stages == 2 * p
    assert [g.pipeline.stages_of(r) for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]
    proof = prove(g.pipeline, g.programs)
    assert proof.ok, [f.render(g.programs) for f in proof.findings]
    assert interpret(g.pipeline, g.programs) == "ok"
    # no transfer at the V's turn (stages p-1 and p are both rank p-1's)
    sent = {a.edge for prog in g.programs.values() for item in prog for a in item if a.kind.is_p2p}
    assert (p - 1, p) not in sent and (p, p - 1) not in sent
    assert len(sent) == 2 * (2 * p - 2)  # every other edge, both directions


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_v_bubble(p):
    """F = I = W = 1 a stage, two stages a rank (6m of compute a rank): from m = 2p-1 on the
    step is 6m + p - 1 and every rank idles (p-1)/(6m+p-1) of it. The p - 1 units are the
    forwards that must run before the last rank's first one, which nothing can fill in a
    step that ends in a synchronised update (the global norm): Qi et al.'s ZB-V is 'zero
    bubble' at T_F = T_B = T_W because they bypass that synchronisation (post-validation),
    so the next step's warm-up overlaps this one's tail. ZB-H1 on the same model (a stage
    there is two here) idles (p-1)/(3m+p-1): ZB-V's bubble is about half of it. Fewer
    micro-batches than 2p-1 may not fill the V (p = 4, m = 4: a step of 30, not 27)."""
    for m in range(1, 3 * p + 2):
        g = generate(Request(S.ZB_V, p, m, 2))
        timing = simulate(prove(g.pipeline, g.programs).graph, Costs(f=1, i=1, w=1))
        bubble = (p - 1) / (6 * m + p - 1)
        assert timing.step >= 6 * m + p - 1  # the last rank's first forward waits p - 1
        if m < 2 * p - 1:
            continue
        assert timing.step == 6 * m + p - 1
        assert all(b == pytest.approx(bubble) for b in timing.bubble.values())
        assert bubble < 0.6 * (p - 1) / (3 * m + p - 1)  # ZB-H1's


@pytest.mark.torch
def test_zb_v_is_torchs_order():
    """The compute order is torch's ScheduleZBVZeroBubble's, action for action."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from types import SimpleNamespace

    zbv = torch_schedules.ScheduleZBVZeroBubble
    for p, m in [(1, 1), (1, 3), *ZB_V]:
        g = generate(Request(S.ZB_V, p, m, 2))
        for r, prog in g.programs.items():
            torch_self = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            want = [str(a) for a in zbv._calculate_single_rank_operations(torch_self, r) if a]
            ours = [f"{a.stage}{a.kind.value}{a.mb}" for a in actions(prog) if not a.kind.is_p2p]
            assert ours == want, (p, m, r)


@pytest.mark.parametrize("p,m,v", [(3, 3, 2), (3, 9, 2), (4, 4, 2), (4, 12, 2), (2, 4, 2)])
def test_interleaved_bubble(p, m, v):
    """F = 1/v, B = 2/v per chunk: (p-1)/(vm+p-1), as the executor waits (lazily); on 2
    ranks the proof's blocking rendezvous costs more than the compute order alone."""
    g = generate(Request(S.INTERLEAVED, p, m, v))
    graph = prove(g.pipeline, g.programs).graph
    textbook = (p - 1) / (v * m + p - 1)
    for b in simulate(graph, Costs(f=1 / v, b=2 / v)).bubble.values():
        assert b == pytest.approx(textbook)
    blocking = simulate(graph, Costs(f=1 / v, b=2 / v), Waits.BLOCKING).bubble.values()
    assert all(b == pytest.approx(textbook) if p >= 3 else b > textbook for b in blocking)


@pytest.mark.parametrize("sched,p,m,v", CASES)
def test_lazy_waits_never_slower_than_blocking(sched, p, m, v):
    """The executor's waits are the proven graph's minus some: never a later step."""
    g = generate(Request(sched, p, m, v))
    graph = prove(g.pipeline, g.programs).graph
    costs = Costs(f=1.3, b=2.9, i=1.1, w=1.7, latency=0.2)
    assert simulate(graph, costs).step <= simulate(graph, costs, Waits.BLOCKING).step + 1e-9


def test_measured_costs_per_stage():
    """Per-stage costs: a slow last stage (the head) sets 1F1B's pace."""
    g = generate(Request(S.ONE_F_ONE_B, 2, 4))
    graph = prove(g.pipeline, g.programs).graph
    costs = Costs.measured({(Kind.F, 0): 1.0, (Kind.B, 0): 2.0, (Kind.F, 1): 2.0, (Kind.B, 1): 4.0})
    assert costs.of(Kind.F, 1) == 2.0 and costs.of(Kind.W, 1) == 1.0  # W: the default
    t = simulate(graph, costs)
    assert t.step == 1 + 4 * 6 + 2  # F0 of stage 0, then stage 1 busy, then B of stage 0
    assert t.bubble[1] == pytest.approx(3 / 27)


def test_latency_adds_to_the_step():
    g = generate(Request(S.ONE_F_ONE_B, 4, 8))
    graph = prove(g.pipeline, g.programs).graph
    assert simulate(graph, Costs(latency=0.5)).step > simulate(graph, Costs()).step
    assert simulate(graph, Costs(gap=0.1)).step > simulate(graph, Costs(post=0.1)).step


# -- the hang classes and other mistakes -----------------------------------------------------

DEFERRED = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"]  # fmt: skip
INVERTED = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"]  # fmt: skip


def test_deferred_receive_is_a_deadlock_between_both_ranks():
    progs = programs_from_torch(DEFERRED)
    proof = prove(Pipeline(2, 2, 2), progs)
    [f] = proof.findings
    assert f.diagnostic.code == "pp-deadlock" and f.ranks == [0, 1]
    msg = f.diagnostic.message
    assert "rank 0 blocks in SEND_F[s0]@mb1 until rank 1 posts RECV_F[s1]@mb1" in msg
    assert "rank 1 blocks in SEND_B[s1]@mb0 until rank 0 posts RECV_B[s0]@mb0" in msg
    text = f.render(progs)
    assert "rank 0" in text.splitlines()[2] and "rank 1" in text.splitlines()[2]
    assert "3 SEND_F[s0]@mb1 <-- blocks" in text and "4 RECV_F[s1]@mb1 <-- not yet posted" in text
    assert interpret(Pipeline(2, 2, 2), progs) == "deadlock"


def test_fifo_inversion_on_one_communicator_is_misdelivery():
    proof = prove(Pipeline(2, 2, 2), programs_from_torch(INVERTED))
    assert proof.codes == ["pp-fifo"]
    assert "RECV_F[s1]@mb1, pairs with rank 0's 1st send to it, SEND_F[s0]@mb0" in (
        proof.findings[0].diagnostic.message
    )


def test_fifo_inversion_across_two_communicators_deadlocks():
    progs = {
        0: parse_program("F[s0]@mb0 SEND_F[s0]@mb0:c1 F[s0]@mb1 SEND_F[s0]@mb1:c2 "
                         "RECV_B[s0]@mb0 B[s0]@mb0 RECV_B[s0]@mb1 B[s0]@mb1"),
        1: parse_program("RECV_F[s1]@mb1:c2 RECV_F[s1]@mb0:c1 F[s1]@mb0 B[s1]@mb0 SEND_B[s1]@mb0 "
                         "F[s1]@mb1 B[s1]@mb1 SEND_B[s1]@mb1"),
    }  # fmt: skip
    proof = prove(Pipeline(2, 2, 2), progs)
    assert proof.codes == ["pp-deadlock"]
    assert "SEND_F[s0]@mb0:c1 until rank 1 posts RECV_F[s1]@mb0:c1" in (
        proof.findings[0].diagnostic.message
    )


def test_1f1b_needs_as_many_microbatches_as_stages():
    [d] = request_errors(Request(S.ONE_F_ONE_B, 4, 2))
    assert d.code == "pp-microbatches"
    assert d.message == "1f1b on 4 stages needs >= 4 micro-batches, got 2"
    with pytest.raises(CompileError):
        generate(Request(S.ZB_H1, 3, 2))
    assert request_errors(Request(S.INTERLEAVED, 2, 3, 2))[0].code == "pp-microbatches"
    assert not request_errors(Request(S.GPIPE, 4, 1))


def test_unclamped_warmup_names_a_microbatch_that_does_not_exist():
    progs = programs_from_torch(["0F0 0F1 0F2 0B0 0B1", "1F0 1F1 1B0 1B1"])
    assert prove(Pipeline(2, 2, 2), progs).codes == ["pp-placement"]


def _edited(drop: Op | None = None, twice: Op | None = None) -> Programs:
    g = generate(Request(S.ONE_F_ONE_B, 2, 4))
    out = {}
    for r, prog in g.programs.items():
        items = []
        for item in prog:
            kept = tuple(a for a in item if a != drop)
            items += [kept] * (2 if twice in item else 1) if kept else []
        out[r] = items
    return out


def test_duplicated_send():
    proof = prove(Pipeline(2, 2, 4), _edited(twice=stage_op(Kind.SEND_F, 0, 1)))
    assert "pp-once" in proof.codes and set(proof.codes) <= {"pp-once", "pp-fifo", "pp-deadlock"}


def test_missing_receive():
    proof = prove(Pipeline(2, 2, 4), _edited(drop=stage_op(Kind.RECV_F, 1, 1)))
    # the transport then pairs rank 0's SEND_F[s0]@mb1 with rank 1's RECV_F[s1]@mb2
    assert sorted(set(proof.codes)) == ["pp-fifo", "pp-order", "pp-unmatched"]
    assert any("never receives it" in f.diagnostic.message for f in proof.findings)


def test_backward_before_forward_is_an_order_error():
    progs = parse_program("B[s0]@mb0 F[s0]@mb0")
    proof = prove(Pipeline(1, 1, 1), {0: progs})
    assert proof.codes == ["pp-order"]


def test_split_backward_runs_each_half_once():
    proof = prove(Pipeline(1, 1, 1), {0: parse_program("F[s0]@mb0 I[s0]@mb0")})
    assert (
        proof.codes == ["pp-once"]
        and "never runs W[s0]@mb0" in proof.findings[0].diagnostic.message
    )


# -- an independent interpreter, and mutations ------------------------------------------------


def _reads(pipe: Pipeline, a: Op, split: bool) -> list[Op]:
    """What an action reads, written here again on purpose (not schedc.ir.pipeline.needs)."""
    bwd = Kind.I if split else Kind.B
    s, m, k = a.stage, a.mb, a.kind
    prev_remote = s > 0 and pipe.rank_of(s - 1) != pipe.rank_of(s)
    next_remote = s + 1 < pipe.stages and pipe.rank_of(s + 1) != pipe.rank_of(s)
    table = {
        Kind.F: [] if s == 0 else [stage_op(Kind.RECV_F if prev_remote else Kind.F,
                                          s if prev_remote else s - 1, m)],
        Kind.W: [stage_op(Kind.I, s, m)],
        Kind.SEND_F: [stage_op(Kind.F, s, m)],
        Kind.SEND_B: [stage_op(bwd, s, m)],
    }  # fmt: skip
    if k in (Kind.B, Kind.I):
        after = [] if s + 1 == pipe.stages else [stage_op(Kind.RECV_B, s, m) if next_remote
                                                 else stage_op(bwd, s + 1, m)]  # fmt: skip
        return [stage_op(Kind.F, s, m), *after]
    return table.get(k, [])


class _Run:
    """The interpreter's state: each rank's next item, what it has done, queue places."""

    def __init__(self, pipe: Pipeline, programs: Programs):
        self.pipe, self.programs = pipe, programs
        self.split = any(a.kind is Kind.I for p in programs.values() for it in p for a in it)
        self.pc = dict.fromkeys(programs, 0)
        self.done: dict[int, set[Op]] = {r: set() for r in programs}
        self.count: dict[tuple, int] = {}
        self.slot: dict[tuple[int, Op], tuple] = {}  # (rank, transfer) -> (queue, place)

    def current(self, r: int):
        prog = self.programs[r]
        return prog[self.pc[r]] if self.pc[r] < len(prog) else None

    def compute(self, r: int, item) -> str:
        [a] = item
        if any(x not in self.done[r] for x in _reads(self.pipe, a, self.split)):
            return f"rank {r} runs {a} before its input"
        self.done[r].add(a)
        self.pc[r] += 1
        return "moved"

    def post(self, r: int, item) -> str:
        for a in item:
            if a.kind.is_send and any(
                x not in self.done[r] for x in _reads(self.pipe, a, self.split)
            ):
                return f"rank {r} sends {a} before computing it"
            if (r, a) not in self.slot:
                peer = self.pipe.rank_of(a.peer_stage)
                q = (r, peer, a.comm, "s") if a.kind.is_send else (peer, r, a.comm, "r")
                self.count[q] = self.count.get(q, 0) + 1
                self.slot[(r, a)] = (q[:3], self.count[q])
        return ""

    def match(self, r: int, a: Op) -> str:
        peer = self.pipe.rank_of(a.peer_stage)
        for b in self.current(peer) or ():
            if not b.kind.is_send and self.slot.get((peer, b)) == self.slot[(r, a)]:
                if b.tag != a.tag:
                    return f"{a} delivered to {b}"
                self.done[r].add(a)
                self.done[peer] |= {b, b._replace(comm="pp")}  # on any communicator
                return "moved"
        return ""

    def transfer(self, p2p: dict) -> str:
        moved = ""
        for r, item in p2p.items():
            for a in item:
                if a.kind.is_send and a not in self.done[r]:
                    got = self.match(r, a)
                    if got not in ("", "moved"):
                        return got
                    moved = moved or got
        return moved

    def step(self) -> str:
        """One round over the ranks: 'moved', '' (nothing could move) or an error."""
        moved = ""
        for r in self.programs:
            item = self.current(r)
            if item is not None and not item[0].kind.is_p2p:
                moved = self.compute(r, item)
                if moved != "moved":
                    return moved
        p2p = {r: it for r in self.programs if (it := self.current(r)) and it[0].kind.is_p2p}
        for r, item in p2p.items():
            if err := self.post(r, item):
                return err
        got = self.transfer(p2p)
        if got not in ("", "moved"):
            return got
        moved = moved or got
        for r, item in p2p.items():
            if all(a in self.done[r] for a in item):
                self.pc[r] += 1
                moved = "moved"
        return moved


def interpret(pipe: Pipeline, programs: Programs) -> str:
    """Run every rank one item at a time: a compute needs its reads done on its rank; a
    transfer completes when the peer's current item holds the receive of the same place on
    the same (src, dst, communicator) queue, and must carry what that receive is for.
    'ok', 'deadlock' or what went wrong."""
    run = _Run(pipe, programs)
    while (said := run.step()) == "moved":
        pass
    if said:
        return said
    if any(run.current(r) is not None for r in programs):
        return "deadlock"
    return _complete(pipe, run.done, run.split)


def _complete(pipe: Pipeline, done: dict[int, set[Op]], split: bool) -> str:
    ran = [a for acts in done.values() for a in acts]
    kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
    want = {stage_op(k, s, m) for k in kinds for s in range(pipe.stages)
            for m in range(pipe.microbatches)}  # fmt: skip
    computed = {a for a in ran if not a.kind.is_p2p}
    return "ok" if computed == want else "incomplete"


def _mutate(programs: Programs, how: str, r: int, i: int, j: int) -> Programs:
    out = {k: list(v) for k, v in programs.items()}
    prog = out[r]
    i, j = i % len(prog), j % len(prog)
    if how == "swap":
        prog[i], prog[j] = prog[j], prog[i]
    elif how == "delete-recv":
        recvs = [k for k, it in enumerate(prog) if any(a.kind in (Kind.RECV_F, Kind.RECV_B)
                                                        for a in it)]  # fmt: skip
        if recvs:
            k = recvs[i % len(recvs)]
            rest = tuple(a for a in prog[k] if a.kind not in (Kind.RECV_F, Kind.RECV_B))
            prog[k : k + 1] = [rest] if rest else []
    elif how == "move-recv-later":
        recvs = [k for k, it in enumerate(prog) if len(it) == 1 and it[0].kind.is_p2p
                 and not it[0].kind.is_send]  # fmt: skip
        if recvs:
            k = recvs[i % len(recvs)]
            (recv,) = prog[k]
            use = next((u for u in range(k + 1, len(prog)) if any(
                a.stage == recv.stage and a.mb == recv.mb and not a.kind.is_p2p
                for a in prog[u])), len(prog))  # fmt: skip
            item = prog.pop(k)  # later, but still before the compute that reads it
            prog.insert(k + j % max(1, use - k), item)
    elif how == "swap-transfers":
        p2p = [k for k, it in enumerate(prog) if it[0].kind.is_p2p]
        a, b = p2p[i % len(p2p)], p2p[j % len(p2p)]
        prog[a], prog[b] = prog[b], prog[a]
    elif how == "split-group":
        k = i
        if len(prog[k]) > 1:
            prog[k : k + 1] = [(a,) for a in reversed(prog[k])]
    return out


_GENERATED: dict = {}


def _generated(sched: Schedule, p: int, m: int, v: int):
    key = (sched, p, m, v)
    if key not in _GENERATED:
        _GENERATED[key] = generate(Request(sched, p, m, v))
    return _GENERATED[key]


@st.composite
def mutants(draw):
    sched, p, m, v = draw(st.sampled_from(CASES))
    g = _generated(sched, p, m, v)
    how = draw(
        st.sampled_from(
            ["swap", "swap-transfers", "delete-recv", "move-recv-later", "split-group", "none"]
        )
    )
    r = draw(st.integers(0, p - 1))
    i, j = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
    progs = g.programs if how == "none" else _mutate(g.programs, how, r, i, j)
    return g.pipeline, progs


@settings(max_examples=250, deadline=None, database=None)
@given(mutants())
def test_proof_agrees_with_the_interpreter(case):
    pipe, progs = case
    proof = prove(pipe, progs)
    ran = interpret(pipe, progs)
    assert proof.ok == (ran == "ok"), (
        proof.codes,
        ran,
        {r: format_program(p) for r, p in progs.items()},
    )
    if proof.ok:
        simulate(proof.graph, Costs())  # a proven program times without error

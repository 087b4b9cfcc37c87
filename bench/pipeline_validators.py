"""What torch.distributed.pipelining's own checkers say about pipeline hangs (issue 31).

    python bench/pipeline_validators.py            # every case, its lists and verdicts
    python bench/pipeline_validators.py --case deferred-recv [--case ...]

Each case is a dict of per-rank `_Action` lists, taken from torch's own schedule classes
where torch builds them, written by hand where it cannot (the hang classes). Each is fed to
what torch applies on a user's path:

- `_validate_schedule` (schedules.py), directly and through
  `_PipelineScheduleRuntime._load_csv(path, format="compute_comms")`, which writes the
  lists to a CSV and loads them as a user would: `_prepare_schedule_with_comms` runs
  `_validate_schedule` and nothing more on such a schedule ("TODO what level of validation
  should we offer for compute+comms schedule?");
- `_add_send_recv`, for lists with no SEND/RECV (torch's own tests lower before simulating);
- `_simulate_comms_compute`, the dry run behind `_PipelineScheduleRuntime._simulate`.

The last two columns are not torch's: `blocking` and `buffered`, this script's model of the
runtime's point-to-point on one NCCL-like stream (see the comment above `_peer`), say
whether the lists complete, deadlock, or pair a send with the wrong receive, when a send
completes only with its receive and when it completes at once. docs/pipeline.md records a
run. No GPU and no second process: the schedule objects are built on torch's fake process
group (rank 0 of a world of 4, no communication); tests/bench/test_pipeline_validators.py
asserts the verdicts still hold on the installed torch.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import _Action, _ComputationType

A = _Action.from_str
C = _ComputationType
WORLD = 4  # the fake world: pipelines of 2 and 4 ranks are groups of it
DP_OPS = (C.UNSHARD, C.RESHARD, C.REDUCE_GRAD)  # data-parallel work, no pipeline P2P


# ---- the world and torch's schedule objects --------------------------------------------


@contextlib.contextmanager
def fake_world() -> Iterator[None]:
    """Rank 0 of a fake world of 4 (torch's `fake` backend: no peers, no communication),
    enough to construct PipelineStage and the schedule classes."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _stages(pp: int, num_stages: int) -> list[PipelineStage]:
    """Rank 0's stages of a `num_stages` pipeline on `pp` ranks (stage s on rank s % pp)."""
    group = dist.new_group(list(range(pp)))
    return [
        PipelineStage(torch.nn.Linear(2, 2), s, num_stages, torch.device("cpu"), group=group)
        for s in range(0, num_stages, pp)
    ]


def _loop(pp: int) -> Callable[[int], int]:
    return lambda s: s % pp


def runtime_schedule(pp: int, n: int, per_rank: int = 1, defer: bool = False):
    """torch's ScheduleInterleaved1F1B, whose runtime lowers it (`pipeline_order_with_comms`:
    _add_unshard_reshard, _add_reduce_grad, _add_send_recv, and with `defer`
    _defer_recv_ops). With one stage per rank it is 1F1B."""
    return ScheduleInterleaved1F1B(_stages(pp, pp * per_rank), n, defer_pp_recv=defer)


# ---- cases ---------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    what: str
    pp: int
    num_stages: int
    n: int
    actions: dict[int, list[_Action]] | None  # None: torch refused to build a schedule
    said: str = ""  # what torch said while building it, if anything
    verdicts: dict[str, str] = field(default_factory=dict)

    @property
    def stage_to_rank(self) -> Callable[[int], int]:
        return _loop(self.pp)


def _lists(*ranks: str) -> dict[int, list[_Action]]:
    return {r: [A(a) for a in text.split()] for r, text in enumerate(ranks)}


def _said(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as e:  # torch's own message is the result
        return f"{type(e).__name__}: {e}"
    return ""


def _runtime_case(name: str, what: str, pp: int, n: int, per_rank: int = 1, defer=False):
    """A case from torch's runtime lists, with what the schedule's own `_simulate()` said."""
    sched = runtime_schedule(pp, n, per_rank, defer)
    lists = {r: list(a) for r, a in sched.pipeline_order_with_comms.items()}
    said = _said(sched._simulate)
    return Case(name, what, pp, pp * per_rank, n, lists, f"_simulate(): {said}" if said else "")


def defer_every_recv(actions: dict[int, list[_Action]]) -> dict[int, list[_Action]]:
    """Each RECV moved to just before the compute that consumes it, on every rank: the
    deferral pytorch#172668 first tried, without the rank-parity rule torch's
    `_defer_recv_ops` has now."""
    out = {}
    for rank, acts in actions.items():
        recv = (C.RECV_F, C.RECV_B)
        recvs = {
            (a.stage_index, a.computation_type, a.microbatch_index): a
            for a in acts
            if a.computation_type in recv
        }
        new: list[_Action] = []
        for a in acts:
            if a.computation_type in recv:
                continue
            need = C.RECV_F if a.computation_type == C.FORWARD else C.RECV_B
            if a.computation_type in (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT):
                key = (a.stage_index, need, a.microbatch_index)
                if key in recvs:
                    new.append(recvs.pop(key))
            new.append(a)
        assert not recvs, f"rank {rank}: receives no compute consumes: {list(recvs.values())}"
        out[rank] = new
    return out


def _edit(actions, rank: int, drop: str = "", twice: str = ""):
    """A copy of `actions` with rank's `drop` removed or its `twice` issued twice."""
    out = {r: list(a) for r, a in actions.items()}
    acts = out[rank]
    if drop:
        acts.remove(A(drop))
    if twice:
        acts.insert(acts.index(A(twice)), A(twice))
    return out


def _few_microbatches() -> list[Case]:
    """torchtitan#775: 2 micro-batches on 4 stages."""
    refused = _said(lambda: Schedule1F1B(_stages(4, 4)[0], 2))
    # torch's own 1F1B timing (Schedule1F1B._get_pipeline_order) evaluated at n = 2: the
    # base class constructor computes it; only Schedule1F1B.__init__'s guard is skipped
    unguarded = Schedule1F1B.__new__(Schedule1F1B)
    S.PipelineScheduleSingle.__init__(unguarded, _stages(4, 4)[0], 2)
    return [
        Case("few-mb-construct", "Schedule1F1B(n_microbatches=2) on 4 stages", 4, 4, 2, None,
             refused),
        Case("few-mb-1f1b-order", "Schedule1F1B's own IR formula at n=2, 4 stages", 4, 4, 2,
             {r: list(a) for r, a in unguarded.pipeline_order.items()}),
        Case("few-mb-unclamped", "by hand: 1F1B with (stages - 1 - rank) warmup forwards, "
             "not clamped to n=2", 4, 4, 2,
             _lists("0F0 0F1 0F2 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2F1 2B0 2B1",
                    "3F0 3B0 3F1 3B1")),
        _runtime_case("few-mb-runtime", "1F1B on torch's runtime (Interleaved1F1B, 1 stage "
                      "a rank), n=2, 4 stages", 4, 2),
    ]  # fmt: skip


def _schedule1f1b_ir() -> Case:
    sched = Schedule1F1B(_stages(2, 2)[0], 4)
    order = {r: list(a) for r, a in sched.pipeline_order.items()}
    return Case("schedule1f1b-ir", "Schedule1F1B(n=4).pipeline_order on 2 ranks", 2, 2, 4, order)


def build_cases() -> list[Case]:
    """Every case, built inside fake_world()."""
    pp2 = _runtime_case("1f1b-pp2", "torch's 1F1B lowered by its runtime, 2 ranks, n=4", 2, 4)
    inter = _runtime_case(
        "interleaved-pp2", "torch's Interleaved1F1B, 2 ranks x 2 stages, n=4", 2, 4, per_rank=2
    )
    return [
        pp2,
        _runtime_case("1f1b-pp4", "torch's 1F1B lowered by its runtime, 4 ranks, n=8", 4, 8),
        _schedule1f1b_ir(),
        inter,
        _runtime_case("interleaved-pp2-defer", "the same with defer_pp_recv=True "
                      "(_defer_recv_ops, rank parity)", 2, 4, per_rank=2, defer=True),
        Case("deferred-recv", "1F1B, 2 ranks, n=2: rank 1 posts 1RECV_F1 after 1SEND_B0", 2,
             2, 2, _lists("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                          "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")),
        Case("deferred-recv-172668", "interleaved-pp2 with every RECV deferred to its "
             "consumer (no parity rule)", 2, 4, 4, defer_every_recv(inter.actions)),
        Case("fifo-inversion", "rank 0 sends mb0 then mb1; rank 1 receives mb1 first", 2, 2,
             2, _lists("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                       "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1")),
        *_few_microbatches(),
        Case("short-error", "4 ranks, n=1, rank 3 runs 3B0 before 3F0", 4, 4, 1,
             _lists("0F0 0B0", "1F0 1B0", "2F0 2B0", "3B0 3F0")),
        Case("missing-recv", "1f1b-pp2 without 1RECV_F1", 2, 2, 4,
             _edit(pp2.actions, 1, drop="1RECV_F1")),
        Case("duplicate-send", "1f1b-pp2 with 0SEND_F1 issued twice", 2, 2, 4,
             _edit(pp2.actions, 0, twice="0SEND_F1")),
    ]  # fmt: skip


# ---- torch's checkers ------------------------------------------------------------------


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0].strip()}"


def validate(case: Case) -> str:
    """`_validate_schedule(actions, pp_group_size, num_stages, num_microbatches)`."""
    try:
        S._validate_schedule(case.actions, case.pp, case.num_stages, case.n)
    except Exception as e:
        return f"rejected: {_first_line(e)}"
    return "accepted"


def load_csv(case: Case) -> str:
    """The user's path for a hand-written schedule: a CSV, one row per rank, loaded by
    `_PipelineScheduleRuntime._load_csv(path, format="compute_comms")` on rank 0."""
    sched = S._PipelineScheduleRuntime(_stages(case.pp, case.num_stages), case.n)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "schedule.csv"
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([str(a) for a in case.actions[r]] for r in range(case.pp))
        try:
            sched._load_csv(str(path), format="compute_comms")
        except Exception as e:
            return f"rejected: {_first_line(e)}"
    return "accepted"


def simulate(case: Case, drop_dp: bool = False) -> str:
    """`_simulate_comms_compute(actions, stage_to_rank, num_stages)`: the number of steps
    its timeline takes, or how it stops. It prints the stalled timeline to stdout, which is
    kept out of ours. With `drop_dp`, UNSHARD/RESHARD/REDUCE_GRAD are removed first, as
    the simulator has no rule for them."""
    acts = {
        r: [a for a in acts if not (drop_dp and a.computation_type in DP_OPS)]
        for r, acts in case.actions.items()
    }
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            timeline = S._simulate_comms_compute(acts, case.stage_to_rank, case.num_stages)
    except Exception as e:
        stuck = [ln for ln in printed.getvalue().splitlines() if ln.startswith("rank=")]
        return f"stops: {_first_line(e)}" + (f" ({'; '.join(stuck)})" if stuck else "")
    steps = max(len(t) for t in timeline.values())
    return f"completes in {steps} steps"


# ---- this script's model of the runtime's point-to-point -------------------------------
# torch's runtime (_PipelineScheduleRuntime._step_microbatches) issues every SEND/RECV as a
# non-blocking isend/irecv on the stage's one process group, and waits on a RECV only in
# the F, B or I that consumes it ("Computing ... before receiving input" if it was never
# posted). On NCCL the group's P2P runs on one communication stream per rank, in issue
# order: a pending recv holds up the sends behind it (pytorch PR #165664), and a send larger
# than NCCL's buffers completes only when the peer's matching recv runs (pytorch#172668's
# two-node hang). Sends and receives pair in issue order per pair of ranks, with no tag
# (the runtime's P2POps carry tag 0): the k-th send from a to b fills the k-th receive b
# posts from a, whatever micro-batch each was issued for.


def _peer(a: _Action, to_rank: Callable[[int], int]) -> int:
    step = 1 if a.computation_type in (C.SEND_F, C.RECV_B) else -1
    return to_rank(a.stage_index + step)


def _meant_for(send: _Action) -> _Action:
    """The receive a send carries data for."""
    if send.computation_type == C.SEND_F:
        return _Action(send.stage_index + 1, C.RECV_F, send.microbatch_index)
    return _Action(send.stage_index - 1, C.RECV_B, send.microbatch_index)


def _waits_on(a: _Action, case: Case) -> _Action | None:
    """The receive a compute action waits for (none when the neighbour stage is local)."""
    to_rank, s = case.stage_to_rank, a.stage_index
    if a.computation_type == C.FORWARD and s > 0 and to_rank(s - 1) != to_rank(s):
        return _Action(s, C.RECV_F, a.microbatch_index)
    backward = a.computation_type in (C.FULL_BACKWARD, C.BACKWARD_INPUT)
    if backward and s < case.num_stages - 1 and to_rank(s + 1) != to_rank(s):
        return _Action(s, C.RECV_B, a.microbatch_index)
    return None


@dataclass
class _Rank:
    acts: list[_Action]
    pc: int = 0  # the next action the rank's CPU issues
    stream: list[_Action] = field(default_factory=list)  # issued, not yet complete
    posted: set[_Action] = field(default_factory=set)
    done: set[_Action] = field(default_factory=set)


def _issue(rank: _Rank, case: Case) -> str | None:
    """Run rank's CPU until a compute waits on a receive; an error if it never posted it."""
    while rank.pc < len(rank.acts):
        a = rank.acts[rank.pc]
        if a.microbatch_index is not None and a.microbatch_index >= case.n:
            return f"{a} is for micro-batch {a.microbatch_index}, of {case.n}"
        if a.computation_type in (C.SEND_F, C.SEND_B, C.RECV_F, C.RECV_B):
            rank.stream.append(a)
            rank.posted.add(a)
        elif (need := _waits_on(a, case)) and need not in rank.done:
            if need not in rank.posted:
                return f"{a} runs before {need} is posted"
            return None
        rank.pc += 1
    return None


def _is_send(a: _Action) -> bool:
    return a.computation_type in (C.SEND_F, C.SEND_B)


def _match_blocking(ranks: dict[int, _Rank], case: Case, wrong: list[str]) -> bool:
    """A send at the head of its stream completes together with the receive at the head of
    the peer's, if that one is from this rank; whether any pair completed."""
    moved = False
    for r, rank in ranks.items():
        if not rank.stream or not _is_send(send := rank.stream[0]):
            continue
        p = _peer(send, case.stage_to_rank)
        other = ranks[p].stream
        if other and not _is_send(other[0]) and _peer(other[0], case.stage_to_rank) == r:
            recv = other.pop(0)
            rank.done.add(rank.stream.pop(0))
            ranks[p].done.add(recv)
            if _meant_for(send) != recv:
                wrong.append(f"{send}->{recv}")
            moved = True
    return moved


def _match_buffered(ranks: dict[int, _Rank], case: Case, box: dict, wrong: list[str]) -> bool:
    """A send at the head completes at once into its (src, dst) queue; a receive at the
    head takes the oldest message of its queue, if there is one."""
    moved = False
    for r, rank in ranks.items():
        while rank.stream:
            head = rank.stream[0]
            p = _peer(head, case.stage_to_rank)
            if _is_send(head):
                box.setdefault((r, p), []).append(head)
            elif box.get((p, r)):
                send = box[(p, r)].pop(0)
                if _meant_for(send) != head:
                    wrong.append(f"{send}->{head}")
            else:
                break
            rank.done.add(rank.stream.pop(0))
            moved = True
    return moved


def rendezvous(case: Case, buffered: bool = False) -> str:
    """Run the lists under the model above: `buffered` False, a send completes only with its
    receive (large messages); True, at once into the peer's queue (small ones)."""
    ranks = {r: _Rank([a for a in acts if a is not None]) for r, acts in case.actions.items()}
    box: dict[tuple[int, int], list[_Action]] = {}  # sent, not yet received, per (src, dst)
    wrong: list[str] = []
    while True:
        for r, rank in ranks.items():
            if err := _issue(rank, case):
                return f"error on rank {r}: {err}"
        if buffered:
            moved = _match_buffered(ranks, case, box, wrong)
        else:
            moved = _match_blocking(ranks, case, wrong)
        if not moved:
            break
    stuck = [
        f"rank {r} at {rank.acts[rank.pc] if rank.pc < len(rank.acts) else 'end'}, "
        f"stream head {rank.stream[0]}"
        for r, rank in ranks.items()
        if rank.stream or rank.pc < len(rank.acts)
    ]
    unread = [str(a) for q in box.values() for a in q]
    out = "deadlock: " + "; ".join(stuck) if stuck else "completes"
    if wrong:
        out += f"; misdelivered {', '.join(wrong)}"
    if unread:
        out += f"; never received {', '.join(unread)}"
    return out


# ---- all of it -------------------------------------------------------------------------


def _has_comms(actions: dict[int, list[_Action]]) -> bool:
    p2p = (C.SEND_F, C.SEND_B, C.RECV_F, C.RECV_B)
    return any(a.computation_type in p2p for acts in actions.values() for a in acts if a)


def check(case: Case) -> Case:
    """Fill case.verdicts: torch's validator and its CSV loader on the lists as they are;
    then, on the lists with their SEND/RECV (compute-only lists are lowered by torch's
    `_add_send_recv` first, as torch's own tests do before simulating), torch's simulator
    (again without the data-parallel actions if it refused them) and the two models."""
    if case.actions is None:
        return case
    v = case.verdicts
    v["validate"] = validate(case)
    v["load_csv"] = load_csv(case)
    comms = case
    if not _has_comms(case.actions):
        try:
            lists = {r: list(a) for r, a in case.actions.items()}
            lowered = S._add_send_recv(lists, case.stage_to_rank, case.num_stages)
        except Exception as e:
            v["_add_send_recv"] = f"rejected: {_first_line(e)}"
            return case
        v["_add_send_recv"] = "lowered"
        comms = Case(case.name, case.what, case.pp, case.num_stages, case.n, lowered)
    v["simulate"] = simulate(comms)
    if "Unsupported action type" in v["simulate"]:
        v["simulate w/o DP ops"] = simulate(comms, drop_dp=True)
    v["blocking"] = rendezvous(comms)
    v["buffered"] = rendezvous(comms, buffered=True)
    return case


def report(case: Case) -> str:
    lines = [f"== {case.name}: {case.what}"]
    if case.said:
        lines.append(f"   torch said: {case.said.strip().splitlines()[0]}")
    for r, acts in sorted((case.actions or {}).items()):
        lines.append(f"   rank {r}: {' '.join(str(a) for a in acts)}")
    lines += [f"   {k:<20} {v}" for k, v in case.verdicts.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="run only this case (repeatable)")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {S.__file__}")
    with fake_world():
        cases = [c for c in build_cases() if not args.case or c.name in args.case]
        for case in cases:
            print(report(check(case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

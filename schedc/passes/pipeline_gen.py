"""Named pipeline schedules as per-rank programs, with their sends and receives.

    generate(Request(Schedule.ONE_F_ONE_B, pp=4, microbatches=8)) -> Generated

Each schedule is first a compute order per rank, from its paper's definition:
- GPipe: every forward, then every backward, micro-batches in order.
- 1F1B (PipeDream-flush, Megatron): rank r runs min(pp-1-r, m) warm-up forwards, then
  alternates one forward and one backward, then drains the backwards.
- Interleaved 1F1B (Megatron, v stages a rank, placement loop): the same over m*v virtual
  micro-batches; virtual forward k is chunk (k // pp) % v of micro-batch
  (k // (pp*v)) * pp + k % pp, backwards walk the chunks in reverse; rank r warms up with
  min(2*(pp-1-r) + (v-1)*pp, m*v) forwards.
- ZB-H1 (Qi et al., zero bubble): 1F1B's order with each backward's input half I in B's
  place; a rank runs a pending weight half W (oldest first) whenever, at unit costs
  (F = I = W = 1), its next F or I would have to wait for its input, or its next F would
  hold more micro-batches (F run, W not) than 1F1B's first rank does, min(pp, m), and the
  rest at the end: ZB-H1's peak memory is 1F1B's (Qi et al. section 3.1).
- ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6; torch 2.13's
  `ScheduleZBVZeroBubble._calculate_single_rank_operations`, whose order this is, action
  for action): two stages a rank placed in a V, rank r holding stages r and 2pp-1-r, so
  the forward runs down the ranks and back up, and the loss stage is on rank 0. Each
  backward is split into I and W; rank r warms up with 2(pp-r)-1 forwards of its first
  stage, then r pairs (second stage, first stage), then pp-r rounds of F, I, W of its second
  stage, then F, I, W of each stage in turn, and drains with the I of both stages and the
  W left. Like torch, the order is made for max(m, 2pp-1) micro-batches and the actions of
  micro-batches past m are dropped, so any m >= 1 runs (below 2pp-1 with a wider bubble).

`add_transfers` then places the communication (torch's `_add_send_recv` does this step for
its IR). It times the compute order at COSTS with sends that never block, and gives every
transfer the time its producer ends: the send goes right after the producer, the receive
into the receiver's program at that time, before any compute that starts at or after it.
On every rank all items then appear in one global order (time; transfers before compute
at a tie; transfers by a global sequence), and a send and its receive share a place in it,
so every happens-before edge goes forward in that order: no cycle, under blocking
rendezvous too. Consecutive transfers to one peer are then issued as one group
(`batch_isend_irecv`), which only removes waits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from schedc.ir.op import Kind, Op, stage_op
from schedc.ir.pipeline import Item, Pipeline, Programs, Schedule, backward_kind, needs, producer
from schedc.lang.diagnostics import CompileError, Diagnostic
from schedc.passes.pipeline_sim import Costs

COSTS = Costs(f=1.0, b=2.0, i=1.0, w=1.0)  # the times transfers are placed by


__all__ = ["Generated", "Request", "Schedule", "generate", "request_errors"]


@dataclass(frozen=True)
class Request:
    schedule: Schedule
    pp: int
    microbatches: int
    v: int = 1  # stages a rank (interleaved; 2 for ZB-V)

    def pipeline(self) -> Pipeline:
        return Pipeline(self.pp, self.pp * self.v, self.microbatches, self.schedule.placement)


@dataclass(frozen=True)
class Generated:
    pipeline: Pipeline
    programs: Programs


def request_errors(req: Request) -> list[Diagnostic]:
    """What a schedule needs of its micro-batch count and v ([pp-microbatches])."""
    name, p, m = req.schedule.value, req.pp, req.microbatches
    if req.schedule is Schedule.ZB_V:  # any m: the order drops the micro-batches past m
        if req.v == 2:
            return []
        return [Diagnostic("pp-microbatches", f"{name} runs v = 2 stages a rank, not v={req.v}")]
    if req.v != 1 and req.schedule is not Schedule.INTERLEAVED:
        return [Diagnostic("pp-microbatches", f"{name} runs one stage a rank, not v={req.v}")]
    if req.schedule is Schedule.INTERLEAVED and req.v < 2:
        return [Diagnostic("pp-microbatches", f"{name} needs v >= 2 stages a rank")]
    if (
        req.schedule is Schedule.GPIPE
        or m >= p
        and (req.schedule is not Schedule.INTERLEAVED or m % p == 0)
    ):
        return []
    if req.schedule is Schedule.INTERLEAVED:
        msg = f"{name} on {p} ranks needs a multiple of {p} micro-batches, got {m}"
        hint = "its virtual micro-batches run in rounds of pp; round m up, or use 1f1b"
    else:
        msg = f"{name} on {p} stages needs >= {p} micro-batches, got {m}"
        hint = (
            f"rank 0 warms up with pp-1 = {p - 1} forwards before its first backward; with "
            f"fewer micro-batches there is no 1F1B steady state: use gpipe, or m >= {p}"
        )
    return [Diagnostic("pp-microbatches", msg, hint=hint)]


def generate(req: Request) -> Generated:
    """The request's programs; a CompileError if the schedule cannot run it."""
    if errors := request_errors(req):
        raise CompileError(errors)
    pipe = req.pipeline()
    orders = ORDERS[req.schedule](pipe)
    return Generated(pipe, add_transfers(pipe, orders))


# -- compute orders -------------------------------------------------------------------------


def gpipe(pipe: Pipeline) -> dict[int, list[Op]]:
    m = range(pipe.microbatches)
    return {
        r: [stage_op(Kind.F, r, k) for k in m] + [stage_op(Kind.B, r, k) for k in m]
        for r in range(pipe.pp)
    }


def _one_f_one_b(pipe: Pipeline, r: int, bwd: Kind) -> list[Op]:
    p, m = pipe.pp, pipe.microbatches
    warm = min(p - 1 - r, m)
    out = [stage_op(Kind.F, r, k) for k in range(warm)]
    for i in range(m - warm):
        out += [stage_op(Kind.F, r, warm + i), stage_op(bwd, r, i)]
    return out + [stage_op(bwd, r, k) for k in range(m - warm, m)]


def one_f_one_b(pipe: Pipeline) -> dict[int, list[Op]]:
    return {r: _one_f_one_b(pipe, r, Kind.B) for r in range(pipe.pp)}


def interleaved(pipe: Pipeline) -> dict[int, list[Op]]:
    p, v, total = pipe.pp, pipe.per_rank, pipe.microbatches * pipe.per_rank

    def virtual(kind: Kind, r: int, k: int) -> Op:
        chunk = (k // p) % v
        if kind is Kind.B:
            chunk = v - 1 - chunk
        return stage_op(kind, chunk * p + r, (k // (p * v)) * p + k % p)

    out = {}
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        acts = [virtual(Kind.F, r, k) for k in range(warm)]
        for j in range(total - warm):
            acts += [virtual(Kind.F, r, warm + j), virtual(Kind.B, r, j)]
        out[r] = acts + [virtual(Kind.B, r, k) for k in range(total - warm, total)]
    return out


def zb_h1(pipe: Pipeline) -> dict[int, list[Op]]:
    """1F1B with I for B; W where the rank would wait (unit costs), or before a forward
    that would hold more micro-batches than 1F1B's peak, the rest at the end."""
    lists = {r: _one_f_one_b(pipe, r, Kind.I) for r in range(pipe.pp)}
    out: dict[int, list[Op]] = {r: [] for r in lists}
    done: dict[Op, int] = {}  # end time of each action run so far
    pending: dict[int, list[Op]] = {r: [] for r in lists}
    free = dict.fromkeys(lists, 0)
    held = dict.fromkeys(lists, 0)  # micro-batches whose F ran and W has not
    t = 0
    while any(lists.values()) or any(pending.values()):
        for r in lists:
            if free[r] > t:
                continue
            full = held[r] >= min(pipe.pp, pipe.microbatches)
            act = _next_zb(pipe, lists[r], pending[r], done, t, full)
            if act is not None:
                out[r].append(act)
                done[act], free[r] = t + 1, t + 1
                held[r] += (act.kind is Kind.F) - (act.kind is Kind.W)
        t += 1
        assert t < 10 * (len(done) + 10), "zb-h1: the order does not progress"
    return out


def _next_zb(
    pipe: Pipeline,
    todo: list[Op],
    pending: list[Op],
    done: dict[Op, int],
    t: int,
    full: bool,
) -> Op | None:
    """The action a ZB-H1 rank starts at time t, taken off its lists (None: it idles).
    While the rank holds as many micro-batches as 1F1B's first rank does (`full`), a forward
    waits for a pending W: a W frees what its I kept, so ZB-H1's peak is 1F1B's."""
    ready = todo and all(done.get(n, t + 1) <= t for n in _inputs(pipe, todo[0], Kind.I))
    if ready and not (full and pending and todo[0].kind is Kind.F):
        act = todo.pop(0)
        if act.kind is Kind.I:
            pending.append(stage_op(Kind.W, act.stage, act.mb))
        return act
    return pending.pop(0) if pending else None


def zb_v(pipe: Pipeline) -> dict[int, list[Op]]:
    """ZB-V's order (the module docstring): each rank's pattern of (kind, stage), numbered
    in turn per kind and stage, made for max(m, 2pp-1) micro-batches, those past m dropped."""
    p, m = pipe.pp, pipe.microbatches
    n = max(m, 2 * p - 1)  # torch: at least the micro-batches that fill the V
    out = {}
    for r in range(p):
        a, b = r, 2 * p - 1 - r  # the rank's stage on the way down, and on the way up
        f0, i0, w0 = (Kind.F, a), (Kind.I, a), (Kind.W, a)
        f1, i1, w1 = (Kind.F, b), (Kind.I, b), (Kind.W, b)
        pattern = (
            [f0] * (2 * (p - r) - 1)
            + [f1, f0] * r
            + [f1, i1, w1] * (p - r)
            + [f0, i0, w0, f1, i1, w1] * (n - 2 * p + r + 1)  # steady: each stage's F, I, W
            + [i0, w0, f1, i1, w1] * (p - r - 1)  # the first stage's forwards are done
            + [i0, i1] * r
            + [i0, w0] * (p - r)
            + [w1] * r
            + [w0] * r
        )
        seen: dict[tuple[Kind, int], int] = defaultdict(int)
        acts = []
        for kind, stage in pattern:
            acts.append(stage_op(kind, stage, seen[kind, stage]))
            seen[kind, stage] += 1
        assert all(k == n for k in seen.values()), f"zb-v rank {r}: {dict(seen)}"
        out[r] = [act for act in acts if act.mb < m]
    return out


ORDERS = {
    Schedule.GPIPE: gpipe,
    Schedule.ONE_F_ONE_B: one_f_one_b,
    Schedule.INTERLEAVED: interleaved,
    Schedule.ZB_H1: zb_h1,
    Schedule.ZB_V: zb_v,
}


# -- communication --------------------------------------------------------------------------


def compute_times(pipe: Pipeline, orders: dict[int, list[Op]], costs: Costs) -> dict:
    """(start, end) of each compute action when sends never block and cost nothing. A rank
    runs its order until an input is not yet timed and waits for that action: each action is
    timed once and each wait woken once (linear; a rank's start is the same in any order)."""
    back = _backward_kind(orders)
    times: dict[Op, tuple[float, float]] = {}
    pos = dict.fromkeys(orders, 0)
    free = dict.fromkeys(orders, 0.0)
    waiting: dict[Op, list[int]] = defaultdict(list)  # an untimed input -> ranks at it
    ready = list(orders)
    while ready:
        r = ready.pop()
        acts = orders[r]
        while pos[r] < len(acts):
            act = acts[pos[r]]
            deps = _inputs(pipe, act, back)
            if (missing := next((d for d in deps if d not in times), None)) is not None:
                waiting[missing].append(r)
                break
            start = max([free[r], *(times[d][1] for d in deps)])
            times[act] = (start, start + costs.of(act.kind))
            free[r], pos[r] = times[act][1], pos[r] + 1
            ready += waiting.pop(act, [])
    stuck = {r: orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])}
    assert not stuck, f"compute order does not progress: {stuck}"
    return times


def _inputs(pipe: Pipeline, act: Op, backward: Kind) -> list[Op]:
    """The compute actions act reads, wherever they run (a receive stands for its producer)."""
    return [producer(d, backward) if d.kind.is_p2p else d for d in needs(pipe, act, backward)]


def _backward_kind(orders: dict[int, list[Op]]) -> Kind:
    return backward_kind(a for acts in orders.values() for a in acts)


def _transfers(pipe: Pipeline, act: Op) -> tuple[Op, Op] | None:
    """The send and receive that carry act's output to another rank, if any."""
    s, m = act.stage, act.mb
    if act.kind is Kind.F and s + 1 < pipe.stages and not pipe.local(s, s + 1):
        return stage_op(Kind.SEND_F, s, m), stage_op(Kind.RECV_F, s + 1, m)
    if act.kind in (Kind.B, Kind.I) and s > 0 and not pipe.local(s, s - 1):
        return stage_op(Kind.SEND_B, s, m), stage_op(Kind.RECV_B, s - 1, m)
    return None


def add_transfers(pipe: Pipeline, orders: dict[int, list[Op]]) -> Programs:
    """The compute orders with every transfer placed (see the module docstring)."""
    times = compute_times(pipe, orders, COSTS)
    keyed: dict[int, list[tuple[tuple, Op]]] = defaultdict(list)
    for r, acts in orders.items():
        keyed[r] += [((times[a][0], 1, k), a) for k, a in enumerate(acts)]
    producers = sorted((times[a][1], pipe.rank_of(a.stage), a) for acts in orders.values()
                       for a in acts if _transfers(pipe, a))  # fmt: skip
    for seq, (end, r, act) in enumerate(producers):
        send, recv = _transfers(pipe, act) or (act, act)
        keyed[r].append(((end, 0, seq), send))
        keyed[pipe.rank_of(recv.stage)].append(((end, 0, seq), recv))
    return {r: group_transfers(pipe, [a for _, a in sorted(keyed[r])]) for r in orders}


def group_transfers(pipe: Pipeline, acts: list[Op]) -> list[Item]:
    """Consecutive transfers to one peer issued as one group."""
    out: list[Item] = []
    for a in acts:
        prev = out[-1] if out else ()
        if a.kind.is_p2p and prev and prev[0].kind.is_p2p and pipe.peer(prev[0]) == pipe.peer(a):
            out[-1] = (*prev, a)
        else:
            out.append((a,))
    return out

"""The pipeline proofs: per-rank programs (generated or written) that run, pair and finish.

    prove(pipe, programs) -> Proof     # .findings: every error; .graph: happens-before

In order, each over all ranks:
- placement [pp-placement]: each action names a stage and micro-batch the pipeline has, on
  the rank that holds the stage; a transfer crosses an edge between two ranks.
- once [pp-once]: per (stage, micro-batch) one F and one B, or one I and one W; no action
  twice.
- order [pp-order]: on each rank an action comes after everything it reads
  (`schedc.ir.pipeline.needs`: F -> I -> W, F -> B, a receive before its consumer, a
  compute before its send).
- matching [pp-unmatched]: every send has exactly one receive of the same tag (stage edge,
  micro-batch, direction) on the same communicator, and every receive one send.
- FIFO [pp-fifo]: the transport pairs the k-th send a -> b on a communicator with the k-th
  receive b <- a on it, whatever each was issued for; both must carry the same tag.
- deadlock [pp-deadlock]: happens-before has no cycle. A rank runs its items one after
  another; a transfer completes when both its send and its receive are posted (blocking
  rendezvous: a send waits for its receive); a group completes when all its transfers have.
  Graph nodes: ("post", r, i) and ("done", r, i) per item, ("xfer", r, i, j) per transfer
  paired by FIFO order, as posted by the sending rank r's item i, member j.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import networkx as nx

from schedc.ir.op import DEFAULT_COMM, Kind, Op, stage_op
from schedc.ir.pipeline import Pipeline, Programs, needs, side_by_side
from schedc.lang.diagnostics import Diagnostic

Where = tuple[int, int]  # (rank, item index)


@dataclass(frozen=True)
class Finding:
    """A diagnostic with the program items it is about, to render side by side."""

    diagnostic: Diagnostic
    marks: dict[Where, str] = field(default_factory=dict)
    rank: int | None = None  # the rank a finding without marks is about (what it never runs)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for r, _ in self.marks})

    def render(self, programs: Programs) -> str:
        text = self.diagnostic.render()
        if self.marks:
            text += "\n" + side_by_side(programs, self.ranks, self.marks)
        return text


@dataclass
class Proof:
    pipeline: Pipeline
    programs: Programs
    findings: list[Finding]
    graph: nx.DiGraph

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def codes(self) -> list[str]:
        return [f.diagnostic.code for f in self.findings]


def locate(programs: Programs) -> dict[Op, list[Where]]:
    where: dict[Op, list[Where]] = defaultdict(list)
    for r, prog in programs.items():
        for i, item in enumerate(prog):
            for a in item:
                where[a].append((r, i))
    return where


def prove(pipe: Pipeline, programs: Programs) -> Proof:
    """Every proof over the programs; later ones run only on what earlier ones let through."""
    where = locate(programs)
    findings = check_placement(pipe, where)
    if findings:  # stages and ranks are not what the pipeline says: nothing more is sound
        return Proof(pipe, programs, findings, nx.DiGraph())
    findings += check_once(pipe, where) + check_order(pipe, programs, where)
    findings += check_matching(pipe, where)
    pairs, fifo = pair_fifo(pipe, programs)
    graph = happens_before(programs, pairs)
    findings += fifo + check_cycle(programs, graph)
    return Proof(pipe, programs, findings, graph)


def _error(
    code: str,
    message: str,
    marks: dict[Where, str],
    hint: str | None = None,
    rank: int | None = None,
) -> Finding:
    return Finding(Diagnostic(code, message, hint=hint), marks, rank)


# -- placement, once, order, matching ---------------------------------------------------------


def _misplaced(pipe: Pipeline, a: Op, rank: int) -> str | None:
    """Why `a` cannot be on `rank`, if it cannot."""
    if not 0 <= a.stage < pipe.stages:
        return f"stage {a.stage} does not exist ({pipe.stages} stages)"
    if a.mb >= pipe.microbatches:
        return f"micro-batch {a.mb} does not exist ({pipe.microbatches} micro-batches)"
    if pipe.rank_of(a.stage) != rank:
        return f"stage {a.stage} runs on rank {pipe.rank_of(a.stage)}"
    if a.kind.is_p2p:
        lo, hi = sorted(a.edge)
        if lo < 0 or hi >= pipe.stages:
            return f"stage {a.peer_stage} does not exist"
        if pipe.local(lo, hi):
            return f"stages {lo} and {hi} are both on rank {rank}: no transfer"
    return None


def check_placement(pipe: Pipeline, where: dict[Op, list[Where]]) -> list[Finding]:
    out = []
    for a, places in where.items():
        for r, i in places:
            if why := _misplaced(pipe, a, r):
                hint = None
                if a.mb >= pipe.microbatches and 0 <= a.stage < pipe.stages:
                    hint = (
                        f"the micro-batches are mb0 .. mb{pipe.microbatches - 1}: a program "
                        "written for more runs out (1F1B's warm-up is min(pp - 1 - rank, m) "
                        "forwards, not pp - 1 - rank)"
                    )
                msg = f"rank {r} runs {a}: {why}"
                out.append(_error("pp-placement", msg, {(r, i): " <--"}, hint))
    return out


def _backward(where: dict[Op, list[Where]], s: int, m: int) -> Kind:
    return Kind.I if stage_op(Kind.I, s, m) in where else Kind.B


def check_once(pipe: Pipeline, where: dict[Op, list[Where]]) -> list[Finding]:
    out = []
    for a, places in where.items():
        if len(places) > 1:
            marks = {p: f" <-- {a} #{k + 1}" for k, p in enumerate(places)}
            out.append(_error("pp-once", f"{a} is issued {len(places)} times", marks))
    for s in range(pipe.stages):
        r = pipe.rank_of(s)
        for m in range(pipe.microbatches):
            split = _backward(where, s, m) is Kind.I
            want = [Kind.F, Kind.I, Kind.W] if split else [Kind.F, Kind.B]
            for k in want:
                if stage_op(k, s, m) not in where:
                    msg = f"rank {r} never runs {stage_op(k, s, m)}"
                    out.append(_error("pp-once", msg, {}, rank=r))
            if split and stage_op(Kind.B, s, m) in where:
                msg = f"stage {s} runs both B and I/W for micro-batch {m}"
                out.append(_error("pp-once", msg, {}, rank=r))
    return out


def check_order(pipe: Pipeline, programs: Programs, where: dict[Op, list[Where]]) -> list[Finding]:
    plain: dict[Op, list[Where]] = defaultdict(list)  # a receive on any communicator
    for a, places in where.items():
        plain[a._replace(comm=DEFAULT_COMM)] += places
    out = []
    for r, prog in programs.items():
        for i, item in enumerate(prog):
            for a in item:
                for need in needs(pipe, a, _backward(where, a.stage, a.mb)):
                    if found := _order_error(r, i, a, need, plain):
                        out.append(found)
    return out


def _order_error(r: int, i: int, a: Op, need: Op, where: dict[Op, list[Where]]) -> Finding | None:
    mine = [j for rr, j in where.get(need, []) if rr == r]
    if not mine:
        if not need.kind.is_p2p:
            return None  # a missing compute is [pp-once]'s
        msg = f"rank {r} runs {a}, whose input {need} it never receives"
        return _error("pp-order", msg, {(r, i): " <-- no receive before"})
    if min(mine) < i:
        return None
    marks = {(r, i): f" <-- needs {need}", (r, min(mine)): " <-- runs here"}
    if min(mine) == i:
        msg = f"rank {r} issues {a} in one group with {need}, which it needs first"
    else:
        msg = f"rank {r} runs {a} (item {i}) before {need} (item {min(mine)}), which it needs"
    return _error("pp-order", msg, marks, hint=f"move {need} before {a}")


def check_matching(pipe: Pipeline, where: dict[Op, list[Where]]) -> list[Finding]:
    """Sends and receives by (tag, communicator); each kept once (a duplicate is
    [pp-once]'s)."""
    sends = Counter((a.tag, a.comm) for a in where if a.kind.is_send)
    recvs = Counter((a.tag, a.comm) for a in where if a.kind.is_p2p and not a.kind.is_send)
    out = []
    for a, places in where.items():
        if not a.kind.is_p2p:
            continue
        other = recvs if a.kind.is_send else sends
        if other[(a.tag, a.comm)]:
            continue
        r, i = places[0]
        peer, verb = pipe.peer(a), "receives" if a.kind.is_send else "sends"
        msg = f"rank {r} issues {a}, and rank {peer} never {verb} it"
        comm = f" on communicator {a.comm!r}" if a.comm != "pp" else ""
        out.append(_error("pp-unmatched", msg + comm, {(r, i): " <-- unmatched"},
                          hint="every send needs exactly one receive of the same stage edge, "
                          "micro-batch and direction, on the same communicator"))  # fmt: skip
    return out


# -- FIFO pairing and happens-before ------------------------------------------------------------

Member = tuple[int, int, int, Op]  # (rank, item, position in the item, action)
_ORDINAL = {1: "st", 2: "nd", 3: "rd"}


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else _ORDINAL.get(k % 10, 'th')}"


def pair_fifo(pipe: Pipeline, programs: Programs) -> tuple[list[tuple[Member, Member]], list]:
    """Sends and receives paired as the transport pairs them: the k-th send a -> b on a
    communicator with the k-th receive b <- a on it. A pair whose tags differ is a FIFO
    inversion [pp-fifo], reported once per queue (the first such pair)."""
    sends: dict[tuple, list[Member]] = defaultdict(list)
    recvs: dict[tuple, list[Member]] = defaultdict(list)
    for r, prog in programs.items():
        for i, item in enumerate(prog):
            for j, a in enumerate(item):
                if a.kind.is_send:
                    sends[(r, pipe.peer(a), a.comm)].append((r, i, j, a))
                elif a.kind.is_p2p:
                    recvs[(pipe.peer(a), r, a.comm)].append((r, i, j, a))
    pairs, findings = [], []
    for key, queue in sends.items():
        matched = list(zip(queue, recvs.get(key, [])))
        pairs += matched
        wrong = [(k, s, v) for k, (s, v) in enumerate(matched) if s[3].tag != v[3].tag]
        if wrong:
            findings.append(_fifo_error(key, wrong))
    return pairs, findings


def _fifo_error(key: tuple, wrong: list[tuple[int, Member, Member]]) -> Finding:
    (src, dst, comm), (k, send, recv) = key, wrong[0]
    more = f" (and {len(wrong) - 1} more mismatched on this queue)" if len(wrong) > 1 else ""
    what = "activation" if send[3].kind.forward else "input gradient"
    msg = (
        f"FIFO inversion: rank {dst}'s {_nth(k + 1)} receive from rank {src} on {comm!r}, "
        f"{recv[3]}, pairs with rank {src}'s {_nth(k + 1)} send to it, {send[3]}: micro-batch "
        f"{send[3].mb}'s {what} lands in {recv[3]}'s buffer{more}"
    )
    marks = {(src, send[1]): f" <-- {_nth(k + 1)} send", (dst, recv[1]): f" <-- {_nth(k + 1)} recv"}
    hint = f"transfers pair in issue order per communicator: post rank {dst}'s receives from " \
        f"rank {src} in the order rank {src} sends"  # fmt: skip
    return _error("pp-fifo", msg, marks, hint)


def happens_before(programs: Programs, pairs: list[tuple[Member, Member]]) -> nx.DiGraph:
    """Items in order on each rank; each paired transfer waits for both ends to be posted
    and completes both ends' items (a group's item completes after all its transfers)."""
    g = nx.DiGraph()
    for r, prog in programs.items():
        for i, item in enumerate(prog):
            g.add_node(("post", r, i), item=item)
            g.add_edge(("post", r, i), ("done", r, i))
            if i:
                g.add_edge(("done", r, i - 1), ("post", r, i))
    for send, recv in pairs:
        x = ("xfer", send[0], send[1], send[2])
        g.add_node(x, send=send, recv=recv)
        for end in (send, recv):
            g.add_edge(("post", end[0], end[1]), x)
            g.add_edge(x, ("done", end[0], end[1]))
    return g


def check_cycle(programs: Programs, graph: nx.DiGraph) -> list[Finding]:
    """[pp-deadlock]: a cycle in happens-before, as the waits that close it."""
    cycle = first_cycle(graph)
    if cycle is None:
        return []
    steps, marks = [], {}
    for k, node in enumerate(cycle):
        if node[0] != "xfer":
            continue
        waited = cycle[k - 1]  # ("post", rank, item): the end that is not yet posted
        x = graph.nodes[node]
        blocked = x["send"] if x["recv"][:2] == waited[1:] else x["recv"]
        other = x["recv"] if blocked is x["send"] else x["send"]
        steps.append(f"rank {blocked[0]} blocks in {blocked[3]} until rank {other[0]} posts "
                     f"{other[3]} (its item {other[1]})")  # fmt: skip
        marks[blocked[:2]] = f" <-- blocks: waits for rank {other[0]}'s {other[3]}"
        marks.setdefault(other[:2], " <-- not yet posted")
    msg = "deadlock: " + "; ".join(steps) + " (each action awaited comes after a block on its rank)"
    hint = (
        "a blocking send completes only together with its receive: post the receive before "
        "the send that waits on it, or issue the two to one peer as one group (batch_isend_irecv)"
    )
    return [_error("pp-deadlock", msg, marks, hint)]


def first_cycle(graph: nx.DiGraph) -> list | None:
    """The nodes of the first cycle a depth-first search meets, from the node it closes on;
    None where there is none. The search is nx.find_cycle's (roots, then successors, in
    insertion order), so the cycle is the one it finds, but each node is entered once:
    find_cycle walks again from every root what earlier roots explored (120 s on 1,000
    stages, where this takes well under a second)."""
    done: set = set()
    for root in graph:
        if root in done:
            continue
        path, on_path = [root], {root}
        stack = [iter(graph.succ[root])]
        while stack:
            for v in stack[-1]:  # resumes the top node's successors where it left them
                if v in on_path:
                    return path[path.index(v) :]
                if v not in done:
                    path.append(v)
                    on_path.add(v)
                    stack.append(iter(graph.succ[v]))
                    break
            else:
                stack.pop()
                on_path.discard(node := path.pop())
                done.add(node)
    return None

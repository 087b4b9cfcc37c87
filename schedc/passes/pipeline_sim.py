"""The timed simulation of a proven pipeline program, and its bubble.

    simulate(graph, Costs(f=1, b=2))                  -> Timing   # .bubble[rank] = idle / step
    simulate(graph, Costs(), Waits.BLOCKING)          -> Timing   # the proof's own model
    simulate(graph, Costs.measured({(Kind.F, 0): 1.3, ...}))     # per-stage costs of a trace

It reads the happens-before graph the proof built (passes/pipeline_check.py), so what is
timed is what was proven. A compute item ends its duration after it is posted, a transfer
item `post` after (its posting; `post_at` a rank's own); a transfer ends `latency` after
the later of its two items starts to be posted (its rendezvous: the posting writes the
data); the next item on a rank is posted `gap` after the previous one ends.
Two ways of waiting for a transfer:

- `Waits.LAZY` (the default: what exec/pipeline.py does): a transfer item is posted and the
  rank goes on; a receive is waited for by the compute that reads it (F[s]@j reads
  RECV_F[s]@j, B[s]@j or I[s]@j reads RECV_B[s]@j), a send at the end of the step. Each
  of its edges is implied by a path of the blocking graph (the reader comes after the
  receive's item on its rank), so it is the proven graph with waits removed: acyclic.
- `Waits.BLOCKING`: a transfer item ends when its transfers have (a group with its last),
  the model the deadlock proof is made under.

The step ends when the last rank does (its last item, or a transfer of it still under way),
and a rank's bubble is the share of the step it is not computing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

import networkx as nx

from schedc.ir.op import Kind, Op
from schedc.ir.pipeline import backward_kind, reader


class Waits(str, Enum):
    LAZY = "lazy"  # posted, then waited for by the reader (receive) or at step end (send)
    BLOCKING = "blocking"  # each transfer item waited for where it is in the program


@dataclass(frozen=True)
class Costs:
    """Durations of the compute actions and the latency of one transfer (any unit); `stage`
    overrides a kind's duration for one stage, `post_at` the posting time for one rank
    (measured costs: `Costs.measured`)."""

    f: float = 1.0
    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    latency: float = 0.0
    post: float = 0.0  # the time a rank spends posting a transfer item (not computing)
    gap: float = 0.0  # host time between one item's end and the next one's start on a rank
    stage: tuple[tuple[tuple[Kind, int], float], ...] = field(default=())
    post_at: tuple[tuple[int, float], ...] = field(default=())

    @cached_property
    def _table(self) -> dict[tuple[Kind, int], float]:
        return dict(self.stage)

    def of(self, kind: Kind, stage: int | None = None) -> float:
        t = self._table.get((kind, stage)) if stage is not None else None
        if t is not None:
            return t
        return {Kind.F: self.f, Kind.B: self.b, Kind.I: self.i, Kind.W: self.w}.get(kind, 0.0)

    @cached_property
    def _posts(self) -> dict[int, float]:
        return dict(self.post_at)

    def posting(self, rank: int) -> float:
        return self._posts.get(rank, self.post)

    @classmethod
    def measured(
        cls,
        means: dict[tuple[Kind, int], float],
        latency: float = 0.0,
        post: float = 0.0,
        gap: float = 0.0,
        post_at: dict[int, float] | None = None,
    ) -> Costs:
        """Per-stage costs from measured means by (kind, stage); a kind never measured keeps
        the unit default (it does not run in that schedule). `post_at`: a rank's own mean
        posting time, where it differs from the others' (which transfers it groups)."""
        return cls(
            latency=latency,
            post=post,
            gap=gap,
            stage=tuple(sorted(means.items())),
            post_at=tuple(sorted((post_at or {}).items())),
        )


@dataclass(frozen=True)
class Timing:
    step: float  # when the last rank ends
    busy: dict[int, float]  # compute time per rank
    starts: dict[tuple[int, int], float]  # (rank, item) -> when it is posted
    ends: dict[tuple[int, int], float]

    @property
    def bubble(self) -> dict[int, float]:
        return {r: (self.step - b) / self.step if self.step else 0.0 for r, b in self.busy.items()}


def lazy(graph: nx.DiGraph) -> nx.DiGraph:
    """The proven graph as the executor waits: a transfer item ends once posted; each
    receive's transfer precedes the post of the compute that reads it."""
    g = graph.copy()
    at: dict[tuple[int, Op], int] = {}  # (rank, compute action) -> item
    for node, data in graph.nodes(data=True):
        if node[0] == "post" and not data["item"][0].kind.is_p2p:
            at[(node[1], data["item"][0])] = node[2]
    back = backward_kind(a for _, a in at)
    for node, data in graph.nodes(data=True):
        if node[0] != "xfer":
            continue
        rank, item, _, recv = data["recv"]
        g.remove_edge(node, ("done", data["send"][0], data["send"][1]))
        g.remove_edge(node, ("done", rank, item))
        g.add_edge(node, ("post", rank, at[(rank, reader(recv, back))]))
    return g


def simulate(graph: nx.DiGraph, costs: Costs, waits: Waits = Waits.LAZY) -> Timing:
    """Times over a proof's graph (acyclic: a proof with no findings)."""
    if waits is Waits.LAZY:
        graph = lazy(graph)
    t: dict[tuple, float] = {}
    busy: dict[int, float] = {}
    ends: dict[int, float] = {}  # rank -> when its last item or transfer ends
    for node in nx.topological_sort(graph):
        ready = _ready(t, graph, node, costs)
        if node[0] == "xfer":
            t[node] = ready + costs.latency
            for end in (graph.nodes[node]["send"], graph.nodes[node]["recv"]):
                ends[end[0]] = max(ends.get(end[0], 0.0), t[node])
            continue
        t[node] = ready
        if node[0] == "done":
            action = graph.nodes[("post", node[1], node[2])]["item"][0]
            if not action.kind.is_p2p:
                cost = costs.of(action.kind, action.stage)
                t[node] = max(ready, t[("post", node[1], node[2])] + cost)
                busy[node[1]] = busy.get(node[1], 0.0) + cost
            else:
                t[node] = max(ready, t[("post", node[1], node[2])] + costs.posting(node[1]))
                busy.setdefault(node[1], 0.0)
            ends[node[1]] = max(ends.get(node[1], 0.0), t[node])
    starts = {(n[1], n[2]): v for n, v in t.items() if n[0] == "post"}
    done = {(n[1], n[2]): v for n, v in t.items() if n[0] == "done"}
    return Timing(max(ends.values(), default=0.0), busy, starts, done)


def _ready(t: dict[tuple, float], graph: nx.DiGraph, node: tuple, costs: Costs) -> float:
    """When `node` may happen: after its predecessors, an item `gap` after the one before."""
    gap = costs.gap if node[0] == "post" else 0.0
    return max(
        (t[p] + (gap if p[0] == "done" else 0.0) for p in graph.predecessors(node)), default=0.0
    )

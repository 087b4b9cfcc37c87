"""The timed simulation of a proven pipeline program, and its bubble.

    simulate(proof, Costs(f=1, b=2)) -> Timing     # .bubble[rank] = idle / step time

It reads the happens-before graph the proof built (passes/pipeline_check.py), so what is
timed is what was proven: a compute item ends its duration after it is posted; a transfer
ends `latency` after both its ends are posted (blocking rendezvous); a group ends with its
last transfer; the next item on a rank is posted when the previous one ends. The step ends
when the last rank does, and a rank's bubble is the share of the step it is not computing
(waiting on a transfer is idle time).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from schedc.ir.pipeline import Kind


@dataclass(frozen=True)
class Costs:
    """Durations of the compute actions and the latency of one transfer (any unit)."""

    f: float = 1.0
    b: float = 2.0
    i: float = 1.0
    w: float = 1.0
    latency: float = 0.0

    def of(self, kind: Kind) -> float:
        return {Kind.F: self.f, Kind.B: self.b, Kind.I: self.i, Kind.W: self.w}.get(kind, 0.0)


@dataclass(frozen=True)
class Timing:
    step: float  # when the last rank ends
    busy: dict[int, float]  # compute time per rank
    starts: dict[tuple[int, int], float]  # (rank, item) -> when it is posted
    ends: dict[tuple[int, int], float]

    @property
    def bubble(self) -> dict[int, float]:
        return {r: (self.step - b) / self.step if self.step else 0.0 for r, b in self.busy.items()}


def simulate(graph: nx.DiGraph, costs: Costs) -> Timing:
    """Times over a proof's graph (acyclic: a proof with no findings)."""
    t: dict[tuple, float] = {}
    busy: dict[int, float] = {}
    for node in nx.topological_sort(graph):
        ready = max((t[p] for p in graph.predecessors(node)), default=0.0)
        if node[0] == "xfer":
            t[node] = ready + costs.latency
            continue
        t[node] = ready
        if node[0] == "done":
            item = graph.nodes[("post", node[1], node[2])]["item"]
            if not item[0].kind.is_p2p:
                t[node] = max(ready, t[("post", node[1], node[2])] + costs.of(item[0].kind))
                busy[node[1]] = busy.get(node[1], 0.0) + costs.of(item[0].kind)
            else:
                busy.setdefault(node[1], 0.0)
    starts = {(n[1], n[2]): v for n, v in t.items() if n[0] == "post"}
    ends = {(n[1], n[2]): v for n, v in t.items() if n[0] == "done"}
    return Timing(max(ends.values(), default=0.0), busy, starts, ends)

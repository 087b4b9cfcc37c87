"""What each node and edge of the schedule graph carries: an `OpNode` per op, a `Dep` per edge.

The graph is a networkx DiGraph keyed by `Op`; each node holds its OpNode and each edge its
Dep under one attribute, read through `node_of`, `dep_of`, `deps` and `preds` (and the
`ScheduleGraph` methods that wrap them), never by string keys. A Dep says two kinds of
fact about one producer -> consumer pair:

* `needs`: why the consumer cannot run before the producer (`Need`); what the checker
  proves holds;
* `sync`: how the program makes it wait, if it does (`Sync`); only these run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import networkx as nx

from schedc.ir.op import Op
from schedc.ir.source import Span


class Need(str, Enum):
    """Why a consumer needs its producer (the text names it in messages and pictures)."""

    ACT = "activation"  # fwd[L] reads fwd[L-1]'s output
    GRAD_IN = "output gradient"  # bwd[L] reads the gradient bwd[L+1] produced
    SAVED = "saved activations"  # bwd[L] reads what fwd[L] (or recompute[L]) saved
    INPUT = "kept input"  # recompute[L] reruns forward from the input fwd[L] kept
    PARAMS = "gathered parameters"  # compute reads a unit's full parameters
    GRADS = "complete gradients"  # a reduction reads gradients its writers produced
    REUSE = "buffer reuse"  # a write into a buffer a collective is still reading
    LAST_USE = "last use"  # a free releases parameters only after their last reader
    WINDOW = "prefetch window"  # a gather waits for memory to come free
    UPDATE = "reduced gradients"  # the optimizer reads every reduction


def said(needs: Iterable[Need]) -> str:
    """Reasons in words, as messages and dumps name them: "activation, buffer reuse"."""
    return ", ".join(n.value for n in needs)


class Sync(str, Enum):
    """How a program makes a consumer wait for its producer."""

    ORDER = "order"  # consecutive ops of one stream
    AFTER = "after"  # a written `after` naming an op of the consumer's own stream
    EVENT = "event"  # a wait across streams: a recorded event


@dataclass
class OpNode:
    """What the graph knows of one op."""

    span: Span | None  # where the file says it: its program line, else its declaration
    seq: int | None = None  # its place in the canonical sequence; None: only the file names it
    stream: str | None = None  # None: no program holds it
    pos: int = -1  # its place in its stream's program (placed ops)
    again: Span | None = None  # a second line that writes it (the checker reports it)

    @property
    def required(self) -> bool:
        """Whether the step needs it (the canonical sequence has it)."""
        return self.seq is not None

    @property
    def placed(self) -> bool:
        return self.stream is not None


@dataclass
class Dep:
    """One edge: why the consumer needs the producer, and how it waits, if it does."""

    needs: list[Need] = field(default_factory=list)
    sync: Sync | None = None
    span: Span | None = None  # the written `after` that makes the wait, if one does


# the one attribute each node and each edge of the networkx graph carries
_NODE, _DEP = "node", "dep"


def add_op(g: nx.DiGraph, op: Op, node: OpNode) -> None:
    g.add_node(op, **{_NODE: node})


def node_of(g: nx.DiGraph, op: Op) -> OpNode:
    node: OpNode = g.nodes[op][_NODE]
    return node


def dep_of(g: nx.DiGraph, u: Op, v: Op) -> Dep:
    dep: Dep = g.edges[u, v][_DEP]
    return dep


def add_dep(g: nx.DiGraph, u: Op, v: Op) -> Dep:
    """The edge u -> v's payload, for adding to; the edge is made, saying nothing yet, if it
    is not there."""
    d = g.get_edge_data(u, v)
    if d is not None:
        dep: Dep = d[_DEP]
        return dep
    dep = Dep()
    g.add_edge(u, v, **{_DEP: dep})
    return dep


def deps(g: nx.DiGraph) -> Iterator[tuple[Op, Op, Dep]]:
    """Every edge with its payload, in the graph's order."""
    yield from g.edges(data=_DEP)


def preds(g: nx.DiGraph, op: Op) -> Iterator[tuple[Op, Dep]]:
    """The producers of `op`'s edges, with their payloads, in the graph's order."""
    for p, d in g.pred[op].items():
        yield p, d[_DEP]


def run_graph(g: nx.DiGraph, placed: Iterable[Op]) -> nx.DiGraph:
    """The graph that runs: program order and waits between placed ops (no payloads)."""
    h = nx.DiGraph()
    h.add_nodes_from(placed)
    # an `after` may name an op no program holds; nothing runs it (the checker says so)
    h.add_edges_from((u, v) for u, v, d in deps(g) if d.sync and u in h and v in h)
    return h

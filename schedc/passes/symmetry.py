"""The proof by classes of ranks (passes/prove.py): a world whose ranks run one plan up to their
own coordinates is executed once a class, not once a rank.

Ranks have coordinates (pipeline rank, replicate index, shard index): g = p x dp + i x S + j
(a data-parallel world has p = 0 only). A class is a pipeline rank's ranks, every (i, j) of
one p; its representative is the rank with i = j = 0. Every rank r of a class is checked here,
in time linear in the world, to be its representative q translated to r's (i, j):

- the same instructions (streams, ops, events, keeps, divisors, batching) and the same
  operands but for the rank, its batch slice and its shard (ir/bound.py);
- each collective's group is either the line or plane of the mesh through the rank (the
  ranks agreeing with it but on some data-parallel dimensions, in rank order: its shard
  group, its replicate group or its whole stage), or a group of ranks sharing its (i, j)
  (a transfer's pair of pipeline ranks, the tied copies' pair), the same pipeline ranks as
  q's;
- its shard is its index in its shard group (so each group's chunks are updated once), its
  batch slice its replica's, and the readers' slices (the ranks whose forward reads the
  batch) partition the global batch with one length per micro-step.

Then what r computes is what q computes with every rank of its values translated, and each
of r's checks is q's translated: the proof executes only the representatives. A collective
over a line or plane of q's class completes when q issues it, since every member issues the
same instruction at the same point of the same plan; its result is the sum of the members'
translated values, a gradient key of q summed over the group's dimensions (passes/values.py
`spread`, with `RankSets`: a key's rank may be a set of ranks, the product of one index or
all of them a dimension). A reduce-scatter's output is every chunk, not q's: the chunks of
the class's members, each checked where its holder updates it. Collectives between classes
(transfers, the tied pair) join representatives, which share (i, j), as in a world of one
replica. A world that is not so (a rank's own program, a plan mutated on one rank, a group
of any other shape) is executed rank by rank, as before: nothing is sampled either way.
docs/proof.md states the argument and its assumptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, product
from operator import is_not

from schedc.ir.bound import Bound
from schedc.ir.mesh import REPLICATE, SHARD, Group, Mesh, span
from schedc.ir.op import Kind
from schedc.ir.plan import Instr
from schedc.ir.spec import Spec

ALL = -1  # a set's index on a dimension it spans
# collectives of a unit's chunks: member p moves chunk p, so their group is the shard group
CHUNKED = (Kind.ALLGATHER, Kind.REDUCESCATTER)


@dataclass
class RankSets:
    """Sets of ranks, each a product of one index or every index a dimension, interned as
    negative integers (a gradient key's rank, passes/values.py); a rank is itself."""

    sizes: tuple[int, ...]  # per dimension, outermost first
    patterns: list[tuple[int, ...]] = field(default_factory=list)
    _ids: dict[tuple[int, ...], int] = field(default_factory=dict)
    _members: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def coords(self, x: int) -> tuple[int, ...]:
        if x < 0:
            return self.patterns[-x - 1]
        out = []
        for size in reversed(self.sizes):
            x, c = divmod(x, size)
            out.append(c)
        return tuple(reversed(out))

    def _id(self, pattern: tuple[int, ...]) -> int:
        if ALL not in pattern:
            rank = 0
            for c, size in zip(pattern, self.sizes):
                rank = rank * size + c
            return rank
        found = self._ids.get(pattern)
        if found is None:
            self.patterns.append(pattern)
            found = self._ids[pattern] = -len(self.patterns)
        return found

    def widen(self, x: int, dims: Sequence[int]) -> tuple[int, int]:
        """`x` summed over a group spanning `dims`, whose members are it translated along
        them: (the set that covers, how many times each of its ranks is counted)."""
        pattern = list(self.coords(x))
        times = 1
        for d in dims:
            if pattern[d] == ALL:
                times *= self.sizes[d]
            pattern[d] = ALL
        return self._id(tuple(pattern)), times

    def members(self, x: int) -> tuple[int, ...]:
        """The ranks of `x`, in rank order."""
        if x >= 0:
            return (x,)
        if x not in self._members:
            axes = [range(s) if c == ALL else (c,) for c, s in zip(self.coords(x), self.sizes)]
            self._members[x] = tuple(self._id(c) for c in product(*axes))
        return self._members[x]


@dataclass
class Symmetry:
    """The classes of a world that has them: each representative, and the dimensions each of
    its collectives' groups spans (none: a group between classes)."""

    sets: RankSets
    reps: tuple[int, ...]
    spans: dict[tuple[int, int], tuple[int, ...]]  # (representative, instruction) -> dims


def data_mesh(spec: Spec) -> Mesh:
    """The mesh the proof's data-parallel groups lie on: a stage's replicate x shard, or
    without a pipeline the world's."""
    return spec.stage_mesh if spec.pipeline is not None else spec.mesh


def readers(spec: Spec) -> range:
    """The ranks whose forward reads the batch: the first stage's pipeline rank's (every
    rank without a pipeline)."""
    ps, dp = spec.pipeline, data_mesh(spec).world
    first = ps.pipeline(spec.accum).rank_of(0) if ps is not None else 0
    return range(first * dp, (first + 1) * dp)


def classes_of(spec: Spec, bounds: Sequence[Bound]) -> Symmetry | None:
    """The world's classes of ranks, if it has them."""
    ps = spec.pipeline
    return symmetry(bounds, data_mesh(spec), ps.degree if ps is not None else 1, readers(spec))


def symmetry(bounds: Sequence[Bound], mesh: Mesh, pp: int, read: range) -> Symmetry | None:
    """The world's classes, if every rank is its representative translated (the module
    docstring); `mesh` is a stage's replicate x shard, `read` the ranks that read the
    batch."""
    dp = mesh.world
    if len(bounds) != pp * dp or dp == 1:
        return None
    sets = RankSets((pp, mesh.replicate, mesh.shard))
    reps = tuple(p * dp for p in range(pp))
    spans: dict[tuple[int, int], tuple[int, ...]] = {}
    for q in reps:
        for k, ins in enumerate(bounds[q].plan.instrs):
            if ins.group and ins.op is not None and ins.op.is_collective:
                found = _span_of(ins.group, q, mesh, sets)
                if found is None or (ins.op.kind in CHUNKED and found != (2,)):
                    return None  # a group of no shape, or chunks moved but by shard index
                spans[(q, k)] = found
    check = _Translated(bounds, mesh, sets, spans)
    if not all(check(g, g - g % dp) for g in range(len(bounds))):
        return None
    if not _replicas_read_alike(bounds, read, dp):
        return None
    return Symmetry(sets, reps, {k: v for k, v in spans.items() if v})


def _span_of(group, q: int, mesh: Mesh, sets: RankSets) -> tuple[int, ...] | None:
    """The data-parallel dimensions `group` spans as a line or plane through q in rank order,
    () for a group of ranks at q's (i, j), or None: a group of no such shape."""
    for dims in ((2,), (1,), (1, 2)):
        if tuple(group) == _line(q, dims, mesh):
            return dims
    at = sets.coords(q)[1:]
    if all(sets.coords(m)[1:] == at for m in group):
        return ()
    return None


def _line(g: int, dims: tuple[int, ...], mesh: Mesh) -> Group:
    """The ranks agreeing with g but on `dims` (1: replicate, 2: shard), in rank order."""
    dp = mesh.world
    base = g - g % dp
    if dims == (1, 2):
        return span(base, base + dp, 1)
    return mesh.members(g % dp, SHARD if dims == (2,) else REPLICATE, base)


class _Translated:
    """Whether rank g is its representative q translated (the module docstring)."""

    def __init__(self, bounds, mesh: Mesh, sets: RankSets, spans) -> None:
        self.bounds, self.mesh, self.sets = bounds, mesh, sets
        self.groups: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # q -> (k, dims)
        for (q, k), dims in spans.items():
            self.groups.setdefault(q, []).append((k, dims))
        self._alike: set[tuple[int, int]] = set()

    def __call__(self, g: int, q: int) -> bool:
        a, b = self.bounds[g], self.bounds[q]
        if a.rank != g:
            return False  # a plan bound to another rank than its place: judged rank by rank
        if g == q:
            return self._own_shard(b)
        if (a.loss_scale, a.steps, a.params, a.grad_keys) != (
            b.loss_scale, b.steps, b.params, b.grad_keys
        ) or not (_same(a.buckets, b.buckets) and _same(a.units, b.units)
                  and _same(a.folds, b.folds)):  # fmt: skip
            return False
        if not self._own_shard(a) or a.plan.streams != b.plan.streams:
            return False
        mine, theirs = a.plan.instrs, b.plan.instrs
        if len(mine) != len(theirs):
            return False
        if mine != theirs:  # the instructions not shared (C-speed scan for them)
            odd = compress(range(len(mine)), map(is_not, mine, theirs))
            if not all(self._alike_but_group(mine[k], theirs[k]) for k in odd):
                return False
        return all(
            self._group(g, mine[k].group, q, theirs[k].group, dims)
            for k, dims in self.groups.get(q, ())
        )

    def _own_shard(self, b: Bound) -> bool:
        return b.shard is None or b.shard == self.mesh.index(b.rank % self.mesh.world, SHARD)

    def _alike_but_group(self, x: Instr, y: Instr) -> bool:
        key = (id(x), id(y))
        if key not in self._alike:
            if (x.kind, x.stream, x.op, x.event, x.keeps, x.divisor, x.batched) != (
                y.kind, y.stream, y.op, y.event, y.keeps, y.divisor, y.batched
            ) or bool(x.group) != bool(y.group):  # fmt: skip
                return False
            if x.op is not None and x.op.kind.is_p2p and x.group != y.group:
                return False  # pipeline ranks of the replica: the same on every replica
            self._alike.add(key)
        return True

    def _group(self, g: int, mine, q: int, theirs, dims: tuple[int, ...]) -> bool:
        if dims:
            want = _line(g, dims, self.mesh)
            return mine is want or tuple(mine) == want
        shift = g - q  # a group at q's (i, j): the same pipeline ranks at g's
        return len(mine) == len(theirs) and all(m == t + shift for m, t in zip(mine, theirs))


def _same(a, b) -> bool:
    return a is b or a == b


def _replicas_read_alike(bounds: Sequence[Bound], read: range, dp: int) -> bool:
    """Every rank's slices are its replica's reader's, and the readers' slices of a
    micro-step have one length: then translating a rank's values translates its checks."""
    lengths = [n for _, n in bounds[read[0]].batch]
    for b in bounds:
        if b.batch != bounds[read[b.rank % dp]].batch:
            return False
    return all([n for _, n in bounds[r].batch] == lengths for r in read)

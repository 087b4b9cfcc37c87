"""The proof that the plans compute the single-process update: abstract execution of every
rank's bound plan at once (translation validation: the plans are checked against what the
schedule means, not against how the lowering made them).

Each rank's instructions run in issue order; a collective is computed when every member of
its communicator (its stream and group) has issued it, the i-th issue of each member being
one collective. A rank that reads a buffer a collective has not yet produced waits for it;
when every rank waits, some rank never issues a collective the others did: a deadlock.

What is tracked, per rank (passes/values.py has the values):
- every gradient buffer (a DDP bucket, a lone parameter's gradient, FSDP's unsharded
  gradient of a micro-step and its accumulator, a reduce-scatter's output, the gradient
  shard), per parameter piece, as an interned map (rank, micro-step, layer) -> Fraction;
- each buffer's writes and reads since it came into being, with their stream and position:
  a read must come after every write by the plan's stream order and events (vector clocks
  from the plan's own records and waits), and a write after every read and write;
- the parameters' version (updates issued) and each gathered unit's: a forward or backward
  reads a unit gathered after the last update, never a freed or stale one.

At every optimizer step, each parameter piece the rank updates must hold the single-process
gradient (passes/values.py's theorem), the FSDP pieces exactly the chunk the rank holds; and
the chunks of every shard group are each updated by one rank. Two steps are executed, so a
buffer carried across the update is read at its version. Instructions mean what ir/bound.py
and ir/effects.py say; collectives mean what torch.distributed documents (docs/proof.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction

import networkx as nx

from schedc.ir.bound import Bound
from schedc.ir.effects import gathers_read
from schedc.ir.op import Kind, Op, Phase
from schedc.ir.plan import Instr
from schedc.ir.sizes import padded
from schedc.ir.spec import SHARD, Spec, Strategy
from schedc.lang.diagnostics import count
from schedc.passes.pipeline_memory import stage_params
from schedc.passes.prove_rank import Piece, Refuted, _Issue, _Rank
from schedc.passes.prove_shape import inside_the_batch, shape
from schedc.passes.prove_stage import StageRank, transfer
from schedc.passes.symmetry import classes_of, data_mesh, readers
from schedc.passes.values import EMPTY, Maps, Theorem, Wrong


@dataclass(frozen=True)
class Proof:
    """What the proof showed (`schedc check`'s proof line)."""

    seqs: int
    per_token: Fraction
    ranks: int
    units: int
    shards: int
    ms: float

    def line(self) -> str:
        shards = (
            f"; {count(self.units, 'unit')} x {count(self.shards, 'shard')} updated once"
            if self.units
            else ""
        )
        return (
            f"every update reads {count(self.seqs, 'sequence')} once at "
            f"{_ratio(self.per_token)} per token; replicas equal{shards} (abstract execution "
            f"of {count(self.ranks, 'plan')}, {self.ms:.1f} ms)"
        )


def prove(spec: Spec, bounds: list[Bound], classes: bool = True) -> Proof:
    """Prove `bounds` (every rank's bound plan) compute the single-process update, or raise
    Refuted. `classes`: by classes of ranks where the world has them (passes/symmetry.py),
    else rank by rank."""
    t0 = time.perf_counter()
    prover = _Prover(spec, bounds, classes)
    prover.run()
    return Proof(
        seqs=spec.seqs,
        per_token=spec.loss_weight(),
        ranks=len(bounds),
        units=len(prover.layout),
        shards=prover.mesh.shard if prover.fsdp else 0,
        ms=(time.perf_counter() - t0) * 1e3,
    )


def _ratio(x: Fraction) -> str:
    return f"{x.numerator:,}/{x.denominator:,}"


class _Prover:
    """The ranks, their communicators, and the values they share."""

    def __init__(self, spec: Spec, bounds: list[Bound], classes: bool = True):
        self.spec, self.bounds = spec, bounds
        self.fsdp = spec.sync is Strategy.FSDP
        # the ranks a unit is sharded over, as replicate x shard (a pipeline: of a stage's)
        self.mesh = data_mesh(spec)
        self.hsdp = self.fsdp and self.mesh.replicate > 1
        self._gathers: dict[Op, tuple[Op, ...]] = {}
        self.maps = Maps()
        self.sym = classes_of(spec, bounds) if classes else None
        slices = {(b.rank, m): b.positions(m) for b in bounds for m in range(len(b.batch))}
        members = self.sym.sets.members if self.sym is not None else (lambda r: (r,))
        self.theorem = Theorem(self.maps, spec.seqs, slices, readers(spec), members)
        model = spec.model
        self.writers = {p.name: tuple(model.writers(p.name)) for p in model.params}
        self.numel = {p.name: p.numel for p in model.params}
        self.written_by: dict[str, list[str]] = {layer: [] for layer in model.layers}
        for p, ws in self.writers.items():
            for w in ws:
                self.written_by[w].append(p)
        self.layout: dict[str, list[tuple[str, int, int]]] = {}
        self.chunk: dict[str, int] = {}
        self.unit_of: dict[str, str] = {}
        self.stage_gathers: dict[int, tuple[Op, ...]] = {}  # FSDP per stage: what it reads
        if self.fsdp:
            self._fsdp_layout()
        executed = self.sym.reps if self.sym is not None else range(len(bounds))
        for b in bounds:  # what can be judged before anything runs (a class: its plan once)
            inside_the_batch(b, spec.seqs)
        for r in executed:
            shape(spec, bounds[r])
        for name in dict.fromkeys(n for b in bounds for n in b.buckets):
            self._agreed("buckets", name)  # one flat layout a bucket, on every holder
        self.queues: dict[tuple[str, tuple[int, ...]], dict[int, list[_Issue]]] = {}
        self.collectives: list[list[_Issue]] = []  # every collective computed: its members
        self.matched: dict[tuple[str, tuple[int, ...]], int] = {}
        self.counts: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        rank = StageRank if spec.pipeline is not None else _Rank
        self.ranks = {r: rank(self, bounds[r]) for r in executed}

    def gathers(self, op: Op) -> tuple[Op, ...]:
        """The all-gathers whose buffers compute op `op` reads (ir/effects.py; a stage op:
        its stage's units')."""
        if op.kind.on_stage:
            return self.stage_gathers.get(op.stage, ()) if not op.kind.is_p2p else ()
        if op not in self._gathers:
            self._gathers[op] = gathers_read(self.spec, op)
        return self._gathers[op]

    def _fsdp_layout(self) -> None:
        """Each unit's flat parameter as the bound plans lay it out (ir/bound.py `units`),
        padded to a multiple of the shard group: every rank holding a unit must lay it out
        alike, since its collectives move flat chunks of it."""
        D, ps = self.mesh.shard, self.spec.pipeline
        units = ps.units if ps is not None else self.spec.fsdp.units
        self.unit_of = {p: u.name for u in units for p in u.params}
        for s in range(len(ps.stages) if ps is not None else 0):
            params = set(stage_params(self.spec, s))
            self.stage_gathers[s] = tuple(
                Op(Kind.ALLGATHER, u.name, 0, Phase.FWD) for u in units if params & set(u.params)
            )
        for u in units:
            order = self._agreed("units", u.name)
            if sorted(order) != sorted(u.params):
                raise Refuted(
                    0, None, f"unit {u.name} is laid out as {', '.join(order)}, not its "
                    f"parameters {', '.join(u.params)} once each"
                )  # fmt: skip
            off, out = 0, []
            for p in order:
                out.append((p, off, self.numel[p]))
                off += self.numel[p]
            self.layout[u.name] = out
            self.chunk[u.name] = padded(off, D) // D

    def _agreed(self, field: str, name: str) -> tuple[str, ...]:
        """The flat order of a bucket or unit (`field`: the bound plans' `buckets` or `units`)
        every rank holding `name` binds: its collectives move flat buffers element by
        element, so every holder must lay it out alike. Located at the first collective of
        the rank that differs."""
        holders = [b for b in self.bounds if name in getattr(b, field)]
        if not holders:
            raise Refuted(0, None, f"no rank's bound plan lays out {name}")
        first = holders[0]
        order = tuple(getattr(first, field)[name])
        for b in holders[1:]:
            mine = tuple(getattr(b, field)[name])
            if mine != order:
                raise self._laid_out(field, name, first.rank, order, b, mine)
        return order

    def _laid_out(self, field: str, name: str, r0: int, order, b: Bound, mine) -> Refuted:
        what = "bucket" if field == "buckets" else "unit"
        why = (
            "its all-reduce sums the flat buffers element by element"
            if what == "bucket"
            else "its gathers and reduce-scatters move flat chunks"
        )
        k = next((k for k, (x, y) in enumerate(zip(order, mine)) if x != y), len(order))
        at = sum(self.numel[p] for p in order[:k])

        def holds(layout) -> str:
            return layout[k] if k < len(layout) else "nothing"

        index = next(
            (n for n, i in enumerate(b.plan.instrs) if i.op is not None and i.op.target == name),
            None,
        )
        return Refuted(
            b.rank,
            index,
            f"rank {b.rank}'s {what} {name} holds {holds(mine)} at element {at:,} where rank "
            f"{r0}'s holds {holds(order)}: {why}, and its members lay the {what} out "
            "differently",
        )

    def run(self) -> None:
        while True:
            progressed = False
            for r in self.ranks.values():
                progressed |= r.advance()
            if all(r.finished for r in self.ranks.values()):
                self._all_matched()
                self._no_circle_of_streams()
                self._shards_once()
                return
            if not progressed:
                self._deadlock()

    # -- collectives ---------------------------------------------------------------------

    def issue(self, issue: _Issue, stream: str) -> None:
        group = self.global_group(issue.rank, issue.instr)
        key = (stream, group)
        queues = self.queues.get(key)
        if queues is None:  # a class's line or plane: its representative issues for all
            alone = self.spans(issue) is not None
            queues = self.queues[key] = {m: [] for m in ((issue.rank,) if alone else group)}
            self.counts[key] = []
        mine = queues.get(issue.rank)
        if mine is None:
            raise Refuted(
                issue.rank,
                issue.index,
                f"{issue.instr.op}: its group {group} does not hold its rank",
            )
        mine.append(issue)
        counts = self.counts[key]  # position -> members that have issued there
        if len(mine) > len(counts):
            counts.append(0)
        counts[len(mine) - 1] += 1
        op = issue.instr.op
        if op is not None and op.kind.is_collective:  # a transfer: its own model (the module doc)
            r = self.ranks[issue.rank]
            issue.after = r.blocked_by(issue.at)
            r.issued[issue.at[0]].append((issue.at[1], issue))
        n = self.matched.get(key, 0)
        while n < len(counts) and counts[n] == len(queues):  # every member issued its n-th
            self._collective([q[n] for q in queues.values()], stream)
            n = self.matched[key] = n + 1

    def _collective(self, issues: list[_Issue], stream: str) -> None:
        first = issues[0]
        for i in issues:
            i.node = len(self.collectives)
        self.collectives.append(issues)
        if first.instr.op is not None and first.instr.op.kind.is_p2p:
            return transfer(self.ranks, issues)
        for i in issues[1:]:
            if i.instr.op != first.instr.op:
                raise Refuted(
                    i.rank,
                    i.index,
                    f"rank {i.rank} issues {i.instr.op} on stream '{stream}' where rank "
                    f"{first.rank} issues {first.instr.op}: they are one collective",
                )
        op = first.instr.op
        assert op is not None
        if op.kind is Kind.ALLGATHER:
            return self._gather(issues)
        outs = self._reduce(issues)
        for i, out in zip(issues, outs):
            self.ranks[i.rank].land(i, out)

    def global_group(self, rank: int, instr: Instr) -> tuple[int, ...]:
        """An instruction's group in global ranks (a transfer's names pipeline ranks of the
        rank's replica, ir/bound.py)."""
        if instr.op is None or not instr.op.kind.is_p2p:
            return instr.group
        dp = self.mesh.world
        return tuple(p * dp + rank % dp for p in instr.group)

    def spans(self, issue: _Issue) -> tuple[int, ...] | None:
        """The dimensions a collective of a class's representative spans, if the proof is by
        classes and its group is a line or plane of the class (passes/symmetry.py)."""
        return None if self.sym is None else self.sym.spans.get((issue.rank, issue.index))

    def _reduce(self, issues: list[_Issue]) -> list[dict[Piece, int]]:
        """Each member's output: the group's sum (of its pieces; a reduce-scatter's member p
        keeps chunk p), each contribution divided by its sender's divisor. A class's: its
        members' translated sends summed, every chunk kept (each is some member's)."""
        op = issues[0].instr.op
        assert op is not None
        dims = self.spans(issues[0])
        if dims is not None:
            i, sets = issues[0], self.sym.sets  # type: ignore[union-attr]

            def over(r: int) -> tuple[int, int]:
                return sets.widen(r, dims)

            return [
                {pc: self.maps.spread(m, over, dims, i.instr.divisor) for pc, m in i.sends.items()}
            ]
        pieces = issues[0].sends.keys()
        for i in issues[1:]:
            if i.sends.keys() != pieces:
                raise Refuted(
                    i.rank,
                    i.index,
                    f"{op} sends other parameters on rank {i.rank} than on rank {issues[0].rank}",
                )
        total = {
            pc: self.maps.combine(tuple((i.sends[pc], i.instr.divisor) for i in issues))
            for pc in pieces
        }
        if op.kind is Kind.ALLREDUCE:
            return [dict(total) for _ in issues]
        return [self._chunk_of(op.target, p, total) for p in range(len(issues))]

    def _chunk_of(self, unit: str, p: int, full: dict[Piece, int]) -> dict[Piece, int]:
        """The pieces of chunk `p` of `unit`'s flat gradient, with their maps."""
        L = self.chunk[unit]
        lo, hi = p * L, (p + 1) * L
        out = {}
        for name, off, n in self.layout[unit]:
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out[(name, a - off, b - off)] = full.get((name, 0, n), EMPTY)  # none: unwritten
        return out

    def _gather(self, issues: list[_Issue]) -> None:
        op = issues[0].instr.op
        assert op is not None
        versions = {i.version for i in issues}
        for p, i in enumerate(issues if self.spans(issues[0]) is None else ()):
            held = self.ranks[i.rank].bound.shard
            if held != p:
                raise Refuted(
                    i.rank,
                    i.index,
                    f"rank {i.rank} holds chunk {held} of {op.target} but is member {p} of "
                    f"its all-gather's group {i.instr.group}: the gathered unit is shuffled",
                )
        for i in issues:
            self.ranks[i.rank].gathered(i, min(versions) if len(versions) == 1 else -1)

    # -- the end -------------------------------------------------------------------------

    def _all_matched(self) -> None:
        for (stream, group), queues in self.queues.items():
            n = self.matched.get((stream, group), 0)
            for q in queues.values():
                if len(q) > n and not self._ahead(q[n], queues, n):
                    self._unanswered(q[n], stream, group, queues)

    def _ahead(self, issue: _Issue, queues, n: int) -> bool:
        """Whether every member that has not issued its part of `issue` still would, where
        it stopped: then the ranks wait for each other, none leaves it out."""
        op, group = issue.instr.op, issue.instr.group
        assert op is not None
        for m, q in queues.items():
            r = self.ranks[m]
            if len(q) > n:
                continue
            if r.finished:
                return False
            rest = r.instrs[r.pc % len(r.instrs) :] if r.started >= r.rounds - 1 else r.instrs
            if not any(
                i.op is not None
                and i.group == group
                and (i.op.tag if op.kind.is_p2p else i.op) == (op.tag if op.kind.is_p2p else op)
                for i in rest
            ):
                return False
        return True

    def _no_circle_of_streams(self) -> None:
        """No collective waits for itself: a collective starts on a member's stream once the
        collective before it there, and the latest of each stream its events waited for, are
        complete, and completes once every member started it. A circle of these (two
        communicators on one stream in opposite orders on two ranks, or waits across streams
        through collectives) is a deadlock even where every communicator is in order."""
        graph = nx.DiGraph()
        for n, members in enumerate(self.collectives):
            graph.add_edges_from({(b.node, n) for i in members for b in i.after if b.node != n})
        if nx.is_directed_acyclic_graph(graph):  # a topological sort: linear, in C-ish loops
            return
        raise self._circle([c for c, _ in nx.find_cycle(graph)])

    def _circle(self, nodes: list[int]) -> Refuted:
        """Where the circle shows: a member whose collective waits for the next one's."""
        steps = []
        for a, b in zip(nodes, nodes[1:] + nodes[:1]):
            i = next(i for i in self.collectives[b] if any(d.node == a for d in i.after))
            d = next(d for d in i.after if d.node == a)
            steps.append((i, d))
        i, d = steps[0]
        said = "; ".join(
            f"rank {i.rank}'s {i.instr.op} on stream '{i.at[0]}' waits for its "
            f"{d.instr.op} on stream '{d.at[0]}'"
            for i, d in steps
        )
        return Refuted(
            i.rank,
            i.index,
            f"the collectives wait for each other in a circle: {said}, and each completes "
            "only once every member has started it",
        )

    def _deadlock(self) -> None:
        self._all_matched()  # names a collective some rank never issues, if there is one
        stuck = [r for r in self.ranks.values() if not r.finished]
        where = "; ".join(f"rank {r.rank} {r.stopped()}" for r in stuck[:4])
        more = f"; and {len(stuck) - 4} more" if len(stuck) > 4 else ""
        r = stuck[0]
        raise Refuted(
            r.rank, r.pc % len(r.instrs), f"the ranks wait for each other forever: {where}{more}"
        )

    def _unanswered(self, issue: _Issue, stream: str, group, queues) -> None:
        n = self.matched.get((stream, group), 0)
        absent = [m for m, q in queues.items() if len(q) <= n]
        raise Refuted(
            absent[0],
            None,
            f"rank{'s' * (len(absent) > 1)} {', '.join(map(str, absent))} never issue"
            f"{'s' * (len(absent) == 1)} {issue.instr.op} on stream '{stream}', which rank "
            f"{issue.rank} issues as its collective #{n} there: the ranks wait forever",
        )

    def _shards_once(self) -> None:
        """Every chunk of every unit is updated by exactly one rank of each shard group (by
        classes: each rank's shard is its index there, passes/symmetry.py)."""
        if not self.fsdp or self.sym is not None:
            return
        for group in self._shard_groups():
            held = sorted(self.bounds[r].shard or 0 for r in group)
            if held != list(range(len(group))):
                r = next(r for r in group if held.count(self.bounds[r].shard or 0) > 1)
                raise Refuted(
                    r,
                    None,
                    f"the ranks {group} update chunks {held} of each unit: every chunk must "
                    "be updated once",
                )

    def _shard_groups(self) -> list[tuple[int, ...]]:
        """Every shard group in global ranks (a pipeline: each pipeline rank's, of its
        stages' dp replicas, pp-outermost)."""
        groups = self.mesh.groups(SHARD)
        if self.spec.pipeline is None:
            return groups
        dp = self.spec.dp
        pp = len(self.bounds) // dp
        return [tuple(p * dp + d for d in g) for p in range(pp) for g in groups]

    def wrong(self, piece: Piece, rank: int, m: int) -> str | None:
        """Why map `m` is not `piece`'s single-process gradient, if it is not."""
        w = self.theorem.check(m, self.writers[piece[0]])
        return None if w is None else _explain(self.spec, piece, rank, w)


def _explain(spec: Spec, piece: Piece, rank: int, w: Wrong) -> str:
    name, lo, hi = piece
    B, D = spec.micro, spec.dp

    def who(n: int) -> str:  # the (rank, micro-step) the spec gives position n to
        if spec.pipeline is not None:
            return f"micro-batch {n // (B * D)} of replica {n % (B * D) // B}"
        return f"micro-step {n // (B * D)} of rank {n % (B * D) // B}"

    what = f"{name}[{lo}:{hi}] on rank {rank}"
    via = f" through bwd[{w.layer}]" if len(spec.model.writers(name)) > 1 else ""
    for wrong, how in ((w.missing, "missing"), (w.twice, "counted twice")):
        if wrong:
            return f"{what}: {who(wrong[0])} {how}{via} ({len(wrong)} of {spec.seqs} sequences)"
    n, x = w.weighed[0]
    return (
        f"{what}: {who(n)} weighs {x * spec.seqs} of its share{via} "
        f"({len(w.weighed)} of {spec.seqs} sequences)"
    )

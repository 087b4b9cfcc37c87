"""One rank of the proof (passes/prove.py): its bound plan executed abstractly, instruction by
instruction, in issue order, with vector clocks from the plan's own streams, records and
waits, and the gradient values of passes/values.py in its buffers."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from schedc.ir.bound import Bound
from schedc.ir.effects import gather_freed, upcast
from schedc.ir.op import COMPUTE, Kind, Op
from schedc.ir.plan import Action, Instr
from schedc.passes.values import EMPTY

Piece = tuple[str, int, int]  # (parameter, first element, end)
At = tuple[str, int, int]  # (stream, position on it, instruction index; -1: the step's start)
STEPS = 2  # steps executed: a buffer kept across the update is read at its version


class Refuted(Exception):
    """The plans do not compute the single-process update: where, and why."""

    def __init__(self, rank: int, index: int | None, message: str):
        super().__init__(message)
        self.rank, self.index, self.message = rank, index, message


@dataclass
class _Buf:
    """A buffer's value per parameter piece, and its last write and read on each stream (an
    access that covers the last one on a stream covers every earlier one there)."""

    pieces: dict[Piece, int] = field(default_factory=dict)
    writes: dict[str, At] = field(default_factory=dict)
    reads: dict[str, At] = field(default_factory=dict)
    version: int = -1  # a gathered unit: the updates its shards had seen
    pending: bool = False  # a collective's output, not yet computed
    value: Any = None  # a pipeline stage's activation or input gradient (passes/prove_stage.py)


@dataclass
class _Issue:
    """One rank's issue of a collective, with what it sends."""

    rank: int
    index: int
    instr: Instr
    at: At
    sends: dict[Piece, int] = field(default_factory=dict)
    version: int = 0
    value: Any = None  # a transfer: what its send carries
    # the collectives this one cannot start before (its stream runs one op at a time, and
    # waits for what its events cover): the latest issued before it on each stream
    after: tuple[_Issue, ...] = ()
    node: int = -1  # the collective it is one member of, once every member issued it


class _Rank:
    def __init__(self, prover: Any, bound: Bound):  # prover: passes/prove.py's _Prover
        self.p, self.bound, self.rank = prover, bound, bound.rank
        self.spec = prover.spec
        self.fsdp = prover.fsdp
        self.upcast = upcast(self.spec)
        self.instrs = bound.plan.instrs
        self.pc = 0  # over `rounds` times the plan
        self.rounds = max(1, -(-STEPS // bound.steps))
        self.started = -1  # the last step begun
        self.updates = 0
        self.pos = {s: -1 for s in bound.plan.streams}
        self.front: dict[str, dict[str, int]] = {s: {} for s in bound.plan.streams}
        # per stream, the collectives issued on it: (position, issue), in order
        self.issued: dict[str, list[tuple[int, _Issue]]] = {s: [] for s in bound.plan.streams}
        self.events: dict[int, dict[str, int]] = {}
        self.bufs: dict[str, _Buf] = {}
        self.done: dict[Op, At] = {}  # this step's forwards, recomputes and backwards
        self.shard_at: At | None = None  # the last update
        self.landing = 0  # FSDP: reductions issued that land in a gradient shard, not done
        self.bucket_of = {p: b for b, ps in bound.buckets.items() for p in ps}
        self.held = bound.params or tuple(prover.writers)  # the parameters it updates
        self.units = list(prover.layout)  # FSDP: the units whose shard it updates
        self._written: dict[tuple[str, int], dict[str, list[str]]] = {}
        self._touches: dict[Op, list[str]] = {}

    @property
    def finished(self) -> bool:
        return self.pc >= self.rounds * len(self.instrs)

    def advance(self) -> bool:
        """Run instructions until the plan ends or one waits on another rank."""
        progressed = False
        while not self.finished:
            k = self.pc % len(self.instrs)
            if self.pc // len(self.instrs) > self.started:
                self.begin_step()
            if not self.execute(k, self.instrs[k]):
                break
            self.pc += 1
            progressed = True
        return progressed

    def fail(self, k: int | None, message: str) -> Refuted:
        return Refuted(self.rank, k, message)

    # -- clocks --------------------------------------------------------------------------

    def _at(self, stream: str, k: int) -> At:
        if stream not in self.pos:
            raise self.fail(k, f"runs on stream '{stream}', which the plan does not have")
        self.pos[stream] += 1
        return (stream, self.pos[stream], k)

    def _done(self, at: At) -> None:
        self.front[at[0]][at[0]] = at[1]

    def blocked_by(self, at: At) -> tuple[_Issue, ...]:
        """The collectives an op at `at` cannot start before: on each stream, the latest
        one issued that the op's stream has reached (its own stream: the one before it)."""
        out = []
        front = self.front[at[0]]
        for stream, issued in self.issued.items():
            limit = at[1] - 1 if stream == at[0] else front.get(stream, -1)
            k = bisect_right(issued, limit, key=lambda pi: pi[0])
            if k:
                out.append(issued[k - 1][1])
        return tuple(out)

    def covered(self, at: At, w: At) -> bool:
        """Whether `w` is complete before the op at `at` starts."""
        if w[0] == at[0]:
            return w[1] < at[1]
        return self.front[at[0]].get(w[0], -1) >= w[1]

    def name(self, at: At) -> str:
        return "the step's start" if at[2] < 0 else str(self.instrs[at[2]].op)

    def read(self, name: str, at: At) -> _Buf:
        buf = self.bufs.get(name)
        if buf is None:
            raise self.fail(at[2], f"{self.name(at)} reads {name}, which does not exist here")
        for w in buf.writes.values():
            if w != at and not self.covered(at, w):
                raise self.fail(
                    at[2],
                    f"{self.name(at)} reads {name} without waiting for {self.name(w)}, "
                    f"which writes it on stream '{w[0]}'",
                )
        buf.reads[at[0]] = at
        return buf

    def write(self, name: str, at: At) -> _Buf:
        buf = self.bufs.setdefault(name, _Buf())
        for w in (*buf.writes.values(), *buf.reads.values()):
            if w != at and not self.covered(at, w):
                raise self.fail(
                    at[2],
                    f"{self.name(at)} writes {name} while {self.name(w)} may still use it "
                    f"on stream '{w[0]}'",
                )
        buf.writes[at[0]] = at
        return buf

    def ready(self, *names: str) -> bool:
        return not any(self.bufs[n].pending for n in names if n in self.bufs)

    # -- the step ------------------------------------------------------------------------

    def begin_step(self) -> None:
        """What the executor does before a step's plan: the buckets are zeroed, on compute."""
        self.started += 1
        self.done = {}
        for name in set(self.bucket_of.values()) | {
            f"grad[{p}]" for p in self.held if p not in self.bucket_of
        }:
            if name in self.bufs:
                at = self._at(COMPUTE, -1)
                self.write(name, at).pieces = {}
                self._done(at)

    def execute(self, k: int, ins: Instr) -> bool:
        if ins.kind is Action.RECORD:
            assert ins.event is not None
            self.events[ins.event] = dict(self.front[ins.stream])
            return True
        if ins.kind is Action.WAIT:
            assert ins.event is not None
            if ins.event not in self.events:
                raise self.fail(k, f"waits for e{ins.event} before it is recorded")
            f = self.front[ins.stream]
            for s, v in self.events[ins.event].items():
                f[s] = max(f.get(s, -1), v)
            return True
        assert ins.op is not None
        if not self.ready(*self.touches(ins.op)):
            return False
        if self.landing and self.reads_shards(ins.op):
            return False  # a gradient shard is still being reduced into
        at = self._at(ins.stream, k)
        self.run(ins, at)
        self._done(at)
        return True

    def stopped(self) -> str:
        """Where the rank waits, and for what (a deadlock's report)."""
        ins = self.instrs[self.pc % len(self.instrs)]
        assert ins.op is not None
        pending = [n for n in self.touches(ins.op) if n in self.bufs and self.bufs[n].pending]
        return f"stops at {ins.op}, waiting for {', '.join(pending) or 'a gradient shard'}"

    def reads_shards(self, op: Op) -> bool:
        """Whether `op` reads the gradient shards (FSDP), which reductions may land in."""
        return op.kind is Kind.STEP

    def touches(self, op: Op) -> list[str]:
        """The buffers `op` reads or writes that a collective may still be producing."""
        if op.kind is Kind.STEP:
            return list(self.bufs)
        if op not in self._touches:
            self._touches[op] = self._touched(op)
        return self._touches[op]

    def _touched(self, op: Op) -> list[str]:
        names = [f"gathered[{g.target}]" for g in self.p.gathers(op)]
        if op.kind is Kind.ALLREDUCE and not self.fsdp:
            names.append(op.target)
        elif op.kind is Kind.ALLREDUCE:
            names.append(f"rs_out[{op.target}]@mb{op.mb}")
        elif op.kind is Kind.BWD and not self.fsdp:
            names += list(self.written(op))
        elif op.kind in (Kind.ALLGATHER, Kind.FREE):
            names.append(f"gathered[{op.target}]")
        return names

    def run(self, ins: Instr, at: At) -> None:
        op = ins.op
        assert op is not None
        if op.kind in (Kind.FWD, Kind.RECOMPUTE):
            self.compute(op, at)
        elif op.kind is Kind.BWD:
            self.backward(op, at)
        elif op.kind is Kind.ALLGATHER:
            self.gather(ins, at)
        elif op.kind is Kind.FREE:
            self.free(op, at)
        elif op.kind.is_collective:
            self.reduce(ins, at)
        else:
            self.update(at)

    # -- compute -------------------------------------------------------------------------

    def compute(self, op: Op, at: At) -> None:
        """A forward or recompute: it reads the gathered units of its layer."""
        if op.kind is Kind.RECOMPUTE:
            self.after(op, at, Op(Kind.FWD, op.target, op.mb))
        else:  # a forward reads the output of the layer before it
            layers = self.spec.model.layers
            i = layers.index(op.target)
            if i > 0:
                self.after(op, at, Op(Kind.FWD, layers[i - 1], op.mb))
        self.read_gathered(op, at)
        self.done[op] = at

    def read_gathered(self, op: Op, at: At) -> None:
        for g in self.p.gathers(op):
            name = f"gathered[{g.target}]"
            buf = self.read(name, at)
            if buf.version != self.updates:
                raise self.fail(
                    at[2],
                    f"{op} reads {name} gathered before update {buf.version + 1}: the "
                    f"parameters after update {self.updates} are not gathered",
                )

    def after(self, op: Op, at: At, need: Op) -> None:
        """`op` uses what `need` made this step (saved activations, a layer's input
        gradient): `need` must have run, and be complete before `op` starts."""
        w = self.done.get(need)
        if w is None or not self.covered(at, w):
            raise self.fail(at[2], f"{op} runs before {need}, whose result it reads")

    def backward(self, op: Op, at: At) -> None:
        layers = self.spec.model.layers
        i = layers.index(op.target)
        again = Op(Kind.RECOMPUTE, op.target, op.mb)
        self.after(op, at, again if again in self.done else Op(Kind.FWD, op.target, op.mb))
        if i + 1 < len(layers):
            self.after(op, at, Op(Kind.BWD, layers[i + 1], op.mb))
        self.read_gathered(op, at)
        self.add(op, (self.rank, op.mb, op.target), self.bound.loss_scale, at)
        self.done[op] = at
        for u in self.bound.folds.get(op.target, ()):
            self.fold(u, op.mb, at)

    def add(self, op: Op, key: tuple[int, int, str], weight: Fraction, at: At) -> None:
        """Backward `op`'s gradient, `key` at `weight`, added into every parameter it writes."""
        for name, params in self.written(op, at[2]).items():
            buf = self.write(name, at)
            added: dict[int, int] = {}  # the old map -> with this micro-step's gradient
            for p in params:
                piece = (p, 0, self.p.numel[p])
                old = buf.pieces.get(piece, EMPTY)
                if old not in added:
                    added[old] = self.p.maps.add(old, key, weight)
                buf.pieces[piece] = added[old]

    def written(self, op: Op, k: int = -1) -> dict[str, list[str]]:
        """Buffer -> the parameters in it whose gradients backward `op` adds into."""
        memo = (op.target, op.mb)
        if memo not in self._written:
            grouped: dict[str, list[str]] = {}
            for p in self.p.written_by[op.target]:
                grouped.setdefault(self.grad_of(p, op.mb, k), []).append(p)
            self._written[memo] = grouped
        return self._written[memo]

    def grad_of(self, p: str, mb: int = 0, k: int = -1) -> str:
        """The buffer parameter `p`'s gradient of micro-step `mb` is added into."""
        if not self.fsdp:
            return self.bucket_of.get(p, f"grad[{p}]")
        if mb >= len(self.bound.grad_keys):
            raise self.fail(k, f"micro-step {mb} has no gradient buffer in the plan")
        return f"grad[{self.p.unit_of[p]}]@mb{self.bound.grad_keys[mb]}"

    def fold(self, unit: str, mb: int, at: At) -> None:
        """No_sync's upcast: micro-step `mb`'s gradient of `unit` added into its accumulator."""
        src = f"grad[{unit}]@mb{self.bound.grad_keys[mb]}"
        if src not in self.bufs:
            return  # nothing of this micro-step to fold (already folded by the take)
        pieces = self.read(src, at).pieces
        acc = self.write(f"acc[{unit}]", at)
        for pc, m in pieces.items():
            acc.pieces[pc] = self.p.maps.combine(((acc.pieces.get(pc, EMPTY), 1), (m, 1)))
        del self.bufs[src]

    # -- collectives ---------------------------------------------------------------------

    def gather(self, ins: Instr, at: At) -> None:
        op = ins.op
        assert op is not None
        if self.shard_at is not None and not self.covered(at, self.shard_at):
            raise self.fail(
                at[2], f"{op} reads the shard of {op.target} while the update may write it"
            )
        buf = self.write(f"gathered[{op.target}]", at)
        buf.writes, buf.reads, buf.pending = {at[0]: at}, {}, True
        self.p.issue(_Issue(self.rank, at[2], ins, at, version=self.updates), at[0])

    def gathered(self, issue: _Issue, version: int) -> None:
        assert issue.instr.op is not None
        buf = self.bufs[f"gathered[{issue.instr.op.target}]"]
        buf.pending, buf.version = False, version

    def free(self, op: Op, at: At) -> None:
        name = f"gathered[{self.freed(op)}]"
        if name not in self.bufs:
            raise self.fail(at[2], f"{op} frees {name}, which is not gathered")
        self.write(name, at)
        del self.bufs[name]

    def freed(self, op: Op) -> str:
        """The unit whose gathered buffer a free releases (ir/effects.py `gather_freed`)."""
        return gather_freed(self.spec, op).target

    def unsharded(self, op: Op, at: At) -> str:
        """The unsharded gradient a reduce-scatter sends: the micro-step's, or under no_sync's
        upcast the accumulator, with what is not yet folded into it folded now (take_grad)."""
        if self.upcast:
            self.fold(op.target, op.mb, at)
            return f"acc[{op.target}]"
        return f"grad[{op.target}]@mb{self.bound.grad_keys[op.mb]}"

    def reduce(self, ins: Instr, at: At) -> None:
        """A reduction: what it sends is read now (and, but for DDP's in place, taken)."""
        op = ins.op
        assert op is not None
        if op.kind is Kind.ALLREDUCE:
            src = op.target if not self.fsdp else f"rs_out[{op.target}]@mb{op.mb}"
        else:
            src = self.unsharded(op, at)
        buf = self.read(src, at)
        issue = _Issue(self.rank, at[2], ins, at, dict(buf.pieces))
        if self.fsdp and (op.kind is Kind.ALLREDUCE or not self.p.hsdp):
            self.landing += 1  # lands in the gradient shard when done
        if op.kind is Kind.REDUCESCATTER:
            del self.bufs[src]  # handed over (FlatUnit.take_grad)
            out = self.write(f"rs_out[{op.target}]@mb{op.mb}", at)
            out.writes, out.reads = {at[0]: at}, {}
            out.pending = True
        else:
            self.write(src, at).pending = True
        self.p.issue(issue, at[0])

    def land(self, issue: _Issue, out: dict[Piece, int]) -> None:
        """A reduction is complete: its output, and where it lands."""
        op = issue.instr.op
        assert op is not None
        if not self.fsdp:  # DDP: in place
            buf = self.bufs[op.target]
            buf.pieces, buf.pending = out, False
            return
        name = f"rs_out[{op.target}]@mb{op.mb}"
        if op.kind is Kind.REDUCESCATTER and self.p.hsdp:
            self.bufs[name].pieces, self.bufs[name].pending = out, False
            return  # the replicate all-reduce sums it first
        self.bufs.pop(name, None)
        self.landing -= 1
        shard = self.bufs.setdefault(f"shard_grad[{op.target}]", _Buf())
        shard.writes[issue.at[0]] = issue.at
        for pc, m in out.items():
            shard.pieces[pc] = self.p.maps.combine(((shard.pieces.get(pc, EMPTY), 1), (m, 1)))

    # -- the update ----------------------------------------------------------------------

    def update(self, at: At) -> None:
        """The optimizer reads every gradient it updates with: each must be the
        single-process one (passes/values.py's theorem)."""
        if self.fsdp:
            for u in self.units:
                self.check_shard(u, at)
        else:
            for p in self.held:
                n = self.p.numel[p]
                buf = self.read(self.grad_of(p), at)
                self.check((p, 0, n), buf.pieces.get((p, 0, n), EMPTY), at, buf)
        self.updates += 1
        self.shard_at = at

    def check_shard(self, unit: str, at: At) -> None:
        name = f"shard_grad[{unit}]"
        buf = self.read_shard(name, at)
        pieces = buf.pieces
        del self.bufs[name]
        held = self.bound.shard or 0
        full = {pc: EMPTY for pc in self._full(unit)}  # by classes: every member's chunk
        want = full if self.p.sym is not None else self.p._chunk_of(unit, held, full)
        if pieces.keys() != want.keys():
            raise self.fail(
                at[2],
                f"the update of chunk {held} of {unit} on rank {self.rank} reads a gradient "
                "shard of other elements: the shard offset is wrong",
            )
        for pc, m in pieces.items():
            self.check(pc, m, at, buf)

    def read_shard(self, name: str, at: At) -> _Buf:
        """Read a unit's gradient shard, which a reduction must have landed in."""
        if name not in self.bufs:
            how = "its reduce-scatter" + (" and the replicate all-reduce" if self.p.hsdp else "")
            raise self.fail(
                at[2], f"{self.name(at)} reads {name}, which {how} never landed in this step"
            )
        return self.read(name, at)

    def _full(self, unit: str) -> list[Piece]:
        return [(p, 0, n) for p, _, n in self.p.layout[unit]]

    def check(self, piece: Piece, m: int, at: At, buf: _Buf) -> None:
        why = self.p.wrong(piece, self.rank, m)
        if why is not None:
            last = max(buf.writes.values(), key=lambda w: w[2], default=None)
            if last is not None:
                why += f"; it was last written by {self.name(last)}"
            raise self.fail(at[2], why)

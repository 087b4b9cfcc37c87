"""What each instruction of a plan does to memory: one semantics, read by the memory ledger,
the checker and the executor.

A buffer is named like an op, by what it holds:

    gathered[u1]      unit u1's full flat parameter, in the gather dtype (all-gather .. free)
    grad[u1]@mb0      unit u1's unsharded gradient that micro-step 0's backward adds into
                      (@mb0 for every micro-step under no_sync: one buffer for the step)
    acc[u1]           no_sync's accumulator in the reduce dtype (FSDP2's upcast), which each
                      micro-step's gradient is folded into by the unit's last writer
    rs_in[u1]@mb0     what u1's reduce-scatter of micro-step 0 sends, held until it retires
                      (gloo's copy of the gradient or of its cast; NCCL makes none, so on
                      CUDA the count is an upper bound)
    rs_out[u1]@mb0    the output shard of that reduce-scatter
    shard_grad[u1]    u1's gradient shard, which the update reads (fp32, a model state from
                      the step's first reduce-scatter of u1 to the update)
    act[h.3]@mb1      what autograd saves for layer h.3 in micro-step 1 (or keeps, if it
                      recomputes)

`lifetimes(spec, plan)` walks a rank's plan in issue order and says, per instruction, in
order: which buffers come into being (`Alloc`) and go (`Free`), and the moments at which
memory is measured (`Measure`), with what the op holds only while it runs on top (its
casts, its activation scratch). What a collective holds (what it sends, a temporary
output) goes when the plan retires it: a wait for a collective retires its stream up to it,
first in first out, and the update retires every stream. Every lifetime rule is
here, once: `passes/memory.py` adds the bytes up, and the executor allocates and frees the
same buffers at the same instructions (tests/exec/test_effects_executor.py replays both).

Streams: on a GPU the caching allocator hands a block back to the stream that allocated it
as soon as the host drops its last reference, in that stream's order, so a buffer that
another stream still reads must be kept alive on the reading stream (`record_stream`;
FSDP2 documents the same aliasing, the reduce-scatter output that the all-reduce of HSDP
reads, in `_fsdp_collectives.py`). `effect(spec, op)` names the cross-stream buffers an op
writes (the first write allocates, on its stream) and reads; `required_keeps` derives the
keeps every read on another stream needs; the lowering writes them into each instruction
(`Instr.keeps`); the checker proves that a plan carries every one (passes/buffers.py,
`[keep-alive]`); the executor keeps exactly those alive. Gathered units are released
through the plan's `free` and its mark, which the allocating stream waits for before the
storage goes back (exec/executor.py `_reclaim`).

Gathered units: `gathered[u]` comes into being at each all-gather of u and goes at each
free of u. Which all-gather's buffer a compute op reads, and which one a free releases, is
`gathers_read` and `gather_freed`: the graph's needs (what a free waits for, what a compute
op waits for; passes/fsdp.py) and the checker's use-after-free (passes/buffers.py, with
vector clocks) both read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from schedc.ir.op import COMPUTE, Kind, Op, Phase
from schedc.ir.plan import Action, Plan
from schedc.ir.sizes import batches_bytes, bucket_numel, layer_acts, padded, unit_numel
from schedc.ir.spec import Dtype, FSDPSpec, Spec, Strategy, UnitSpec
from schedc.model.arch import FP32, GPTConfig


@dataclass(frozen=True)
class Effect:
    """The buffers one op writes (the first write allocates) and reads."""

    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()


NONE = Effect()


def upcast(spec: Spec) -> bool:
    """FSDP under no_sync with a reduce dtype wider than the gather dtype: each micro-step's
    gradient, in the gather dtype, is folded into an accumulator in the reduce dtype
    (FSDP2's `to_accumulated_grad_if_needed`), and the reduce-scatter takes the accumulator."""
    n = spec.numerics
    return spec.kind is Strategy.FSDP and spec.no_sync and n.reduce.nbytes > n.gather.nbytes


def grad_key(spec: Spec, mb: int) -> int:
    """Which unsharded gradient micro-step `mb` writes: its own, or under no_sync the one that
    accumulates the whole step and is reduce-scattered once (its own again under the upcast,
    where each micro-step's is folded into the accumulator)."""
    return 0 if spec.no_sync and not upcast(spec) else mb


def grad_buffer(spec: Spec, unit: str, mb: int) -> str:
    """The unsharded gradient of `unit` that micro-step `mb`'s reduce-scatter takes."""
    return f"acc[{unit}]" if upcast(spec) else f"grad[{unit}]@mb{grad_key(spec, mb)}"


def scatter_output(unit: str, mb: int) -> str:
    return f"rs_out[{unit}]@mb{mb}"


def shard_grad(unit: str) -> str:
    return f"shard_grad[{unit}]"


def direct(spec: Spec) -> bool:
    """Whether a unit's first reduce-scatter of the step writes straight into its new
    gradient shard: when the reduce dtype is the shard's own (fp32); else its output is a
    temporary, cast back into the shard when the collective completes."""
    return spec.numerics.reduce is Dtype.FP32


def effect(spec: Spec, op: Op) -> Effect:
    """The cross-stream buffers `op` writes and reads (module docstring)."""
    if spec.kind is not Strategy.FSDP:
        return NONE
    fs = spec.fsdp
    if op.kind is Kind.BWD:
        writes = []
        for unit, first in _units_written(spec.model, fs).get(op.target, ()):
            writes.append(f"grad[{unit}]@mb{grad_key(spec, op.mb)}")
            if upcast(spec) and first:
                writes.append(f"acc[{unit}]")
        return Effect(writes=tuple(writes))
    if op.kind is Kind.REDUCESCATTER:
        out = scatter_output(op.target, op.mb)
        # without HSDP the output lands in the shard when the reduce-scatter completes, on
        # its own stream; with HSDP its replicate all-reduce does that (below)
        lands = () if spec.hsdp and not direct(spec) else (shard_grad(op.target),)
        return Effect(writes=(out, *lands), reads=(grad_buffer(spec, op.target, op.mb),))
    if op.kind is Kind.ALLREDUCE:  # HSDP: a unit's gradient shard over the replicate group
        lands = () if direct(spec) else (shard_grad(op.target),)
        return Effect(writes=lands, reads=(scatter_output(op.target, op.mb),))
    if op.kind is Kind.STEP:
        return Effect(reads=tuple(shard_grad(u.name) for u in fs.units))
    return NONE


@functools.lru_cache(maxsize=16)
def _units_written(model: GPTConfig, fs: FSDPSpec) -> dict[str, tuple[tuple[str, bool], ...]]:
    """Layer -> (unit, whether this layer's backward writes the unit's gradient first) for
    each unit whose gradient the layer's backward writes, in unit order: asked once per
    backward op, so kept per schedule instead of walking every unit's parameters again."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for u in fs.units:
        ws = frozenset(w for p in u.params for w in model.writers(p))
        first = min(ws, key=model.layer_index) if ws else None
        for w in ws:
            out.setdefault(w, []).append((u.name, w == first))
    return {layer: tuple(units) for layer, units in out.items()}


# -- gathered units: whose buffer each compute op reads and each free releases -------------------


def gather_of(spec: Spec, unit: UnitSpec, mb: int, phase: Phase) -> Op:
    """The all-gather whose buffer `unit`'s use in micro-step `mb`'s `phase` reads: that use's
    own; forward's, for backward, when the unit is not resharded after forward; the step's
    one gather, for a unit kept gathered."""
    if unit.keep:
        return Op(Kind.ALLGATHER, unit.name, 0, Phase.FWD)
    if phase is Phase.BWD and not spec.fsdp.reshard_after_forward:
        phase = Phase.FWD
    return Op(Kind.ALLGATHER, unit.name, mb, phase)


def gathers_read(spec: Spec, op: Op) -> tuple[Op, ...]:
    """The all-gathers whose buffers a compute op reads (FSDP): one per unit of its layer.
    A recompute reads backward's, like the backward it precedes."""
    if spec.kind is not Strategy.FSDP or op.kind not in (Kind.FWD, Kind.RECOMPUTE, Kind.BWD):
        return ()
    phase = Phase.FWD if op.kind is Kind.FWD else Phase.BWD
    return tuple(gather_of(spec, u, op.mb, phase) for u in spec.fsdp.units if op.target in u.layers)


def gather_freed(spec: Spec, op: Op) -> Op:
    """The all-gather whose buffer a free releases."""
    unit = next(u for u in spec.fsdp.units if u.name == op.target)
    return gather_of(spec, unit, op.mb, op.phase or Phase.BWD)


@dataclass(frozen=True)
class Missing:
    """A read on a stream that does not keep its buffer alive (`required_keeps`)."""

    index: int  # the instruction
    buffer: str
    allocated_on: str
    read_on: str


def _cross_reads(spec: Spec, instrs):
    """(instruction index, instruction, buffer, allocating stream) for every read of a
    buffer that another stream allocated, in issue order."""
    allocated: dict[str, str] = {}
    for k, ins in enumerate(instrs):
        if ins.op is None:
            continue
        e = effect(spec, ins.op)
        for b in e.reads:
            src = allocated.get(b, ins.stream)
            if src != ins.stream:
                yield k, ins, b, src
        for b in e.writes:
            allocated.setdefault(b, ins.stream)


def required_keeps(spec: Spec, instrs) -> dict[int, tuple[str, ...]]:
    """Instruction index -> the buffers it must keep alive on its stream: those it reads
    that another stream allocated (the first to write them)."""
    keeps: dict[int, tuple[str, ...]] = {}
    for k, _, b, _ in _cross_reads(spec, instrs):
        keeps[k] = (*keeps.get(k, ()), b)
    return keeps


def missing_keeps(spec: Spec, instrs) -> list[Missing]:
    """Every read of a buffer allocated on another stream that its instruction does not
    keep alive (what the checker's `[keep-alive]` reports)."""
    return [
        Missing(k, b, src, ins.stream)
        for k, ins, b, src in _cross_reads(spec, instrs)
        if b not in ins.keeps
    ]


# -- lifetimes: what lives when, in bytes -------------------------------------------------------


class Part(str, Enum):
    """What a buffer is counted as, in the memory report's parts."""

    STATES = "model states"
    GATHERED = "gathered units"
    GRADS = "unsharded gradients"
    COMM = "communication buffers"
    ACTS = "activations"


@dataclass(frozen=True)
class Alloc:
    """`buffer` comes into being, `nbytes` of `part`."""

    buffer: str
    part: Part
    nbytes: int


@dataclass(frozen=True)
class Free:
    """`buffer` goes."""

    buffer: str


@dataclass(frozen=True)
class Measure:
    """Memory is measured here: everything live, plus what the op holds only while it runs
    (`comm`: its casts and temporary outputs; `acts`: its activation scratch)."""

    comm: int = 0
    acts: int = 0


Step = Alloc | Free | Measure


@dataclass(frozen=True)
class Lifetimes:
    """A plan's memory semantics: what lives before the first instruction (`before`), and
    each instruction's steps, in the plan's issue order."""

    before: tuple[Step, ...]
    steps: tuple[tuple[Step, ...], ...]
    states: int  # the model states between steps and at the update (fp32): the report's


def lifetimes(spec: Spec, plan: Plan) -> Lifetimes:
    """Every buffer's lifetime along `plan` (the module docstring)."""
    return _Walk(spec, plan).run()


class _Walk:
    """The walk along the issue order that `lifetimes` makes."""

    def __init__(self, spec: Spec, plan: Plan):
        self.spec, self.plan = spec, plan
        self.fsdp = spec.kind is Strategy.FSDP
        num = spec.numerics
        self.g, self.r = num.gather.nbytes, num.reduce.nbytes
        self.acts = {layer: layer_acts(spec, layer) for layer in spec.model.layers}
        self.saved: dict[tuple[str, int], int] = {}  # (layer, mb) -> bytes it holds now
        if self.fsdp:
            fs, D = spec.fsdp, spec.mesh.shard  # units shard over the shard dimension
            self.D = D
            self.numel = {u.name: padded(unit_numel(spec, u), D) for u in fs.units}  # P
            self.writers = {u.name: spec.writers(u.params) for u in fs.units}
            self.last_writer = {
                u: min(ws, key=spec.model.layer_index) for u, ws in self.writers.items()
            }
            self.upcast = upcast(spec)
            self.grads: set[str] = set()  # unsharded gradients (and accumulators) live
            self.gathered: set[str] = set()  # units gathered now
            self.scattered: set[str] = set()  # units reduce-scattered so far in the step
        # what the collectives issued and not yet retired hold: stream -> [(op, buffer)]
        self.held: dict[str, list[tuple[Op, str]]] = {}
        self.outs: set[str] = set()  # HSDP: reduce-scatter outputs its all-reduce will hold
        self.issued: dict[Op, int] = {}

    def run(self) -> Lifetimes:
        spec, plan = self.spec, self.plan
        if self.fsdp:
            shards = {u: n // self.D for u, n in self.numel.items()}
            states = sum(4 * FP32 * s for s in shards.values())
            # between steps a rank holds its parameter shard and Adam m, v; each gradient
            # shard exists from the unit's first reduce-scatter of the step to the update
            held = sum(3 * FP32 * s for s in shards.values())
        else:
            states = held = 4 * FP32 * spec.model.numel  # DDP's bucket is the gradient
        before = (
            Alloc("states", Part.STATES, held),
            Alloc("batches", Part.ACTS, batches_bytes(spec)),
            Measure(),
        )
        stream_of = {i.op: i.stream for i in plan.instrs if i.kind is Action.RUN}
        steps = []
        for ins in plan.instrs:
            if ins.kind is Action.WAIT and ins.event is not None and ins.event != plan.step_start:
                # a wait retires its stream's queue up to the op it waits for (FIFO); the step
                # start has no producer op (comm streams wait for compute: nothing to retire)
                producer = plan.producers[ins.event]
                steps.append(tuple(self.retire(stream_of[producer], producer)))
            elif ins.kind is Action.RUN and ins.op is not None:
                self.issued[ins.op] = len(self.issued)
                steps.append(tuple(self.op(ins.op, ins.stream)))
            else:
                steps.append(())
        return Lifetimes(before, tuple(steps), states)

    def retire(self, stream: str | None = None, upto: Op | None = None) -> list[Step]:
        """The collectives of `stream` issued up to and including `upto` (every stream's,
        with none) are retired: what they hold goes."""
        gone: list[Step] = []
        for s in [stream] if stream is not None else list(self.held):
            keep = []
            for op, buffer in self.held.get(s, []):
                if upto is None or self.issued[op] <= self.issued[upto]:
                    gone.append(Free(buffer))
                else:
                    keep.append((op, buffer))
            self.held[s] = keep
        return gone

    def hold(self, op: Op, stream: str, buffer: str, nbytes: int) -> Alloc:
        """`op`'s collective holds `buffer` until it is retired."""
        self.held.setdefault(stream, []).append((op, buffer))
        return Alloc(buffer, Part.COMM, nbytes)

    def op(self, op: Op, stream: str) -> list[Step]:
        if op.kind is Kind.STEP:
            # the update drains every stream first; it allocates nothing of size (fused
            # AdamW, foreach norms, clipping in place)
            return [*self.retire(), Measure(), *self.updated()]
        if not self.fsdp:
            comm = 0
            if op.kind is Kind.ALLREDUCE and self.spec.kind is Strategy.DDP and self.r != FP32:
                comm = bucket_numel(self.spec, op.target) * self.r  # bf16_compress_hook's cast
            return self.compute(op, comm)
        if op.kind is Kind.ALLGATHER:
            return self.gather(op)
        if op.kind is Kind.FREE:
            return self.free(op)
        if op.kind is Kind.REDUCESCATTER:
            return self.reduce_scatter(op, stream)
        if op.kind is Kind.ALLREDUCE:  # HSDP's: it reads the reduce-scatter's output, if any
            out = scatter_output(op.target, op.mb)
            if out in self.outs:  # it holds it until it is retired itself
                self.outs.discard(out)
                self.held.setdefault(stream, []).append((op, out))
            return self.compute(op)
        return self.backward(op) if op.kind is Kind.BWD else self.compute(op)

    # a plan the checker refuses (a free before its gather, a gather of a unit gathered) still
    # gets a walk, for the memory budget's diagnostic: what is not there is not freed

    def gather(self, op: Op) -> list[Step]:
        gathered = f"gathered[{op.target}]"
        n, g = self.numel[op.target], self.g
        steps: list[Step] = []
        if gathered not in self.gathered:
            self.gathered.add(gathered)
            steps.append(Alloc(gathered, Part.GATHERED, n * g))
        # the shard cast for the gather (one rank casts straight into the gathered buffer)
        comm = n // self.D * g if g != FP32 and self.D > 1 else 0
        return steps + self.compute(op, comm)

    def free(self, op: Op) -> list[Step]:
        gathered = f"gathered[{op.target}]"
        freed = [Free(gathered)] if gathered in self.gathered else []
        self.gathered.discard(gathered)
        return [*freed, *self.compute(op)]

    def backward(self, op: Op) -> list[Step]:
        """FSDP's backward: the unsharded gradients its parameters write into come into being
        (under the upcast, folded into the accumulator after it)."""
        steps: list[Step] = []
        for u, ws in self.writers.items():
            name = f"grad[{u}]@mb{grad_key(self.spec, op.mb)}"
            if op.target in ws and name not in self.grads:
                self.grads.add(name)
                steps.append(Alloc(name, Part.GRADS, self.numel[u] * self.g))
        steps += self.compute(op)
        if self.upcast:
            steps += self.fold(op)
        return steps

    def compute(self, op: Op, comm: int = 0) -> list[Step]:
        """The op's activations around its measure: a forward saves (or, recomputing,
        keeps its input), a recompute saves the rest, a backward frees once it ends."""
        if op.kind not in (Kind.FWD, Kind.RECOMPUTE, Kind.BWD):
            return [Measure(comm)]
        a, key, name = self.acts[op.target], (op.target, op.mb), f"act[{op.target}]@mb{op.mb}"
        if op.kind is Kind.BWD:
            # its saved tensors go when it ends: until then they are part of what it holds
            # while it runs, and not of what lives after it
            held = self.saved.pop(key, 0)
            return [Free(name), Measure(comm, a.bwd + held)] if held else [Measure(comm, a.bwd)]
        steps: list[Step] = [Free(name)] if key in self.saved else []
        now = a.kept if op.kind is Kind.FWD and op.target in self.spec.recompute else a.saved
        self.saved[key] = now
        return [*steps, Alloc(name, Part.ACTS, now), Measure(comm, a.fwd)]

    def fold(self, op: Op) -> list[Step]:
        """No_sync's upcast: a unit whose last writer this backward is folds the micro-step's
        gradient into the accumulator (the first fold casts: both live for a moment)."""
        steps: list[Step] = []
        for u in (u for u, w in self.last_writer.items() if w == op.target):
            if f"acc[{u}]" not in self.grads:
                self.grads.add(f"acc[{u}]")
                steps += [Alloc(f"acc[{u}]", Part.GRADS, self.numel[u] * FP32), Measure()]
            self.grads.discard(f"grad[{u}]@mb{op.mb}")
            steps.append(Free(f"grad[{u}]@mb{op.mb}"))
        return steps

    def reduce_scatter(self, op: Op, stream: str) -> list[Step]:
        """What a reduce-scatter sends and writes (passes/memory.py's docstring has the
        byte counts): it takes the unsharded gradient over, holds what it sends until it is
        retired, and its output shard when that is not the new gradient shard itself."""
        u, n, D, r = op.target, self.numel[op.target], self.D, self.r
        first = u not in self.scattered
        steps: list[Step] = []
        comm = 0
        if D > 1:  # what it sends, in the reduce dtype: gloo's copy of the gradient or cast
            steps.append(self.hold(op, stream, f"rs_in[{u}]@mb{op.mb}", n * r))
        if r != self.g and not self.upcast:
            comm += n * r  # the cast to the reduce dtype, a temporary of the op
        if not (first and r == FP32):
            # the output shard, added (or cast back) into the fp32 one when retired; HSDP's,
            # once its replicate all-reduce has summed it in place and is retired itself
            out = scatter_output(u, op.mb)
            if self.spec.hsdp:
                self.outs.add(out)
                steps.append(Alloc(out, Part.COMM, n // D * r))
            else:
                steps.append(self.hold(op, stream, out, n // D * r))
        if first:  # the gradient shard comes into being
            steps.append(Alloc(shard_grad(u), Part.STATES, n // D * FP32))
        steps += self.compute(op, comm)
        # the executor hands the unsharded gradient over (FlatUnit.take_grad): from here only
        # what the collective holds lives on, until it is retired
        self.scattered.add(u)
        taken = grad_buffer(self.spec, u, op.mb)
        if taken in self.grads:
            self.grads.discard(taken)
            steps.append(Free(taken))
        if stream == COMPUTE:  # on compute a collective blocks, like a kernel
            steps += self.retire(COMPUTE, op)
        return steps

    def updated(self) -> list[Step]:
        """After the update: the gradient shards go (they come back at the next step's first
        reduce-scatter)."""
        if not self.fsdp:
            return []
        gone, self.scattered = sorted(self.scattered), set()
        return [Free(shard_grad(u)) for u in gone]

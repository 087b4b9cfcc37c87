"""What a plan's instructions do to the buffers that one stream hands to another.

A buffer is named like an op, by what it holds:

    grad[u1]@mb0      unit u1's unsharded gradient that micro-step 0's backward adds into
                      (@mb0 for every micro-step under no_sync: one buffer for the step)
    acc[u1]           no_sync's accumulator in the reduce dtype (FSDP2's upcast), which each
                      micro-step's gradient is folded into by the unit's last writer
    rs_out[u1]@mb0    the output shard of u1's reduce-scatter for micro-step 0
    shard_grad[u1]    u1's gradient shard, which the update reads (fp32)

Each instruction that runs an op writes some buffers and reads others, on its stream. The
first write of a buffer in the step allocates it, on that stream. On a GPU the caching
allocator hands a block back to the stream that allocated it as soon as the host drops its
last reference, in that stream's order: a buffer that another stream still reads must be
kept alive on the reading stream (`record_stream`; FSDP2 documents the same aliasing, the
reduce-scatter output that the all-reduce of HSDP reads, in `_fsdp_collectives.py`). So
every read of a buffer on a stream other than its allocating one needs a keep:

    `required_keeps` derives them from these effects; the lowering writes them into each
    instruction (`Instr.keeps`); the checker proves that a plan carries every one
    (passes/check.py, `[keep-alive]`); the executor keeps exactly those alive.

Gathered units are not here: they are released through the plan's `free` and its mark,
which the allocating stream waits for before the storage goes back (exec/executor.py
`_reclaim`), and use-after-free is a rule of the graph. DDP's buckets and one process's
gradients live for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.op import Kind, Op
from schedc.ir.spec import Dtype, Spec, Strategy


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
    fs = spec.strategy
    if op.kind is Kind.BWD:
        writes = []
        for u in fs.units:
            ws = spec.writers(u.params)
            if op.target in ws:
                writes.append(f"grad[{u.name}]@mb{grad_key(spec, op.mb)}")
                if upcast(spec) and op.target == min(ws, key=spec.model.layer_index):
                    writes.append(f"acc[{u.name}]")
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

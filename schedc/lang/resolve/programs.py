"""Streams and written programs: `stream allreduce = side` moves an op kind to a stream of
its own; `program comm [on rank N] { ... }` writes a stream's ops in order, each op checked
against what the schedule has (its layers, buckets or units, micro-steps)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schedc.ir.op import COMM, COMPUTE, PLAN_KINDS, Kind, Op, OpSyntaxError
from schedc.ir.source import Span
from schedc.ir.spec import DDPSpec, FSDPSpec, InstrSpec, ProgramSpec, Strategy
from schedc.lang.diagnostics import did_you_mean
from schedc.lang.resolve.context import Context
from schedc.lang.resolve.values import int_of
from schedc.lang.syntax import Program, ProgramLine, StreamDecl
from schedc.model.arch import GPTConfig

STREAM_KINDS = {k.value: k for k in PLAN_KINDS}


@dataclass(frozen=True)
class Scope:
    """What a written op may name."""

    cfg: GPTConfig | None  # its layers
    strategy: DDPSpec | FSDPSpec | None  # its buckets or units
    world: int | None  # the ranks a program may be written for
    accum: int | None  # micro-steps mb0 .. mb{accum - 1}
    hsdp: bool  # a mesh R x S with R > 1: FSDP programs all-reduce units too


def resolve_streams(cx: Context, strategy: DDPSpec | FSDPSpec | None) -> dict[Kind, str]:
    """Each op kind's stream: collectives on comm and compute on compute unless moved (DDP's
    all-reduce stays on compute under `overlap off`)."""
    streams = {k: (COMM if k.is_collective else COMPUTE) for k in PLAN_KINDS}
    if isinstance(strategy, DDPSpec) and not strategy.overlap:
        streams[Kind.ALLREDUCE] = COMPUTE
    for d in cx.all(StreamDecl):
        kind = STREAM_KINDS.get(d.kind.text)
        if kind is None:
            cx.err(
                "unknown-name",
                f"unknown op kind '{d.kind.text}'",
                d.kind.span,
                hint=did_you_mean(d.kind.text, STREAM_KINDS) or f"kinds: {', '.join(STREAM_KINDS)}",
            )
            continue
        if not cx.once(f"stream.{kind.value}", d.span, f"the stream of {kind.value}"):
            continue
        if kind.is_compute and d.stream.text != COMPUTE:
            cx.err(
                "compute-stream",
                f"{kind.value} is compute work and runs on the "
                f"compute stream, not '{d.stream.text}'",
                d.stream.span,
                hint="only collectives can move to another stream",
            )
            continue
        if (
            kind is Kind.ALLREDUCE
            and isinstance(strategy, DDPSpec)
            and not strategy.overlap
            and d.stream.text != COMPUTE
        ):
            cx.err(
                "conflict",
                f"overlap off keeps all-reduce on the compute stream, but "
                f"this puts it on '{d.stream.text}'",
                d.span,
                hint="drop `overlap off`, or this line",
            )
            continue
        streams[kind] = d.stream.text
    return streams


def resolve_programs(
    cx: Context, streams: dict[Kind, str], scope: Scope
) -> tuple[ProgramSpec, ...]:
    """The written programs, one per stream and rank, with the instructions that check."""
    out = []
    known = {COMPUTE, COMM, *streams.values()}
    for p in cx.all(Program):
        stream = p.stream.text
        if stream not in known:
            cx.err(
                "unknown-name",
                f"unknown stream '{stream}'",
                p.stream.span,
                hint=did_you_mean(stream, known)
                or "streams are compute, comm, and those named by `stream` lines",
            )
            continue
        rank = None
        if p.rank is not None:
            rank = int_of(cx.diag, p.rank, "rank", 0, max(0, (scope.world or 1) - 1))
            if rank is None:
                continue
        on_rank = f" on rank {rank}" if rank is not None else ""
        if not cx.once(
            f"program.{stream}.{rank}", p.span, f"the program of stream '{stream}'{on_rank}"
        ):
            continue
        instrs = (_instr(cx, ins, stream, scope) for ins in p.instrs)
        out.append(ProgramSpec(stream, rank, tuple(i for i in instrs if i is not None), p.span))
    return tuple(out)


def _instr(cx: Context, ins: ProgramLine, stream: str, scope: Scope) -> InstrSpec | None:
    """One line of a program: its op and those it waits for, or None after reporting."""
    op = _op(cx, ins.op.text, ins.op.span, scope)
    afters = [(_op(cx, a.text, a.span, scope), a.span) for a in ins.after]
    waits = tuple(a for a, _ in afters if a is not None)
    if op is None or len(waits) < len(afters):
        return None
    if op.kind.is_compute and stream != COMPUTE:
        cx.err(
            "compute-stream",
            f"{op} is compute work, written on stream '{stream}'",
            ins.op.span,
            hint="write it in `program compute`",
        )
        return None
    return InstrSpec(op, waits, ins.span, tuple(s for _, s in afters))


def _op(cx: Context, text: str, span: Span, scope: Scope) -> Op | None:
    """An op's text parsed and its target, kind and micro-step checked."""
    try:
        op = Op.parse(text)
    except OpSyntaxError as e:
        cx.err("syntax", str(e), span, hint=did_you_mean(*e.suggest) if e.suggest else None)
        return None
    if op.kind.on_stage:
        cx.err(
            "unexpected-op",
            f"{op} is a pipeline stage's action, in a program of the plan",
            span,
            hint="a stream's program runs layers (fwd[h.0]@mb0), buckets and units; "
            "stage actions go in `program on rank N` of a pipeline block",
        )
        return None
    cfg, strategy = scope.cfg, scope.strategy
    if cfg is None or op.kind is Kind.STEP:
        return op
    targets: Sequence[str]
    if op.kind in (Kind.FWD, Kind.BWD, Kind.RECOMPUTE):
        targets, what = cfg.layers, "layer"
    elif op.kind is Kind.ALLREDUCE and isinstance(strategy, FSDPSpec) and scope.hsdp:
        targets, what = [u.name for u in strategy.units], "unit"  # HSDP's replicate step
    elif op.kind is Kind.ALLREDUCE:
        targets = [b.name for b in strategy.buckets] if isinstance(strategy, DDPSpec) else []
        what = "bucket"
    else:
        targets = [u.name for u in strategy.units] if isinstance(strategy, FSDPSpec) else []
        what = "unit"
    if not targets:
        cx.err(
            "unexpected-op",
            f"{op} has no place in {Strategy.of(strategy).a_label} schedule",
            span,
            hint="DDP schedules all-reduce buckets; FSDP schedules gather, free "
            "and reduce-scatter units (and all-reduce them under a mesh R x S, R > 1)",
        )
        return None
    if op.target not in targets:
        cx.err(
            "unknown-name",
            f"unknown {what} '{op.target}' in {op}",
            span,
            hint=(None if cx.diag.full else did_you_mean(op.target, targets))
            or f"{what}s: {', '.join(targets)}",
        )
        return None
    if scope.accum is not None and op.mb >= scope.accum:
        cx.err(
            "value-range",
            f"{op} names micro-step {op.mb}, but this schedule has mb0 .. mb{scope.accum - 1}",
            span,
        )
        return None
    return op

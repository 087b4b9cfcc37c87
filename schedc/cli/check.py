"""`schedc check`: prove schedules legal, print a summary or a stage's text, compare two."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from schedc.cli.common import add_override_args, overrides, require
from schedc.compiler import Compiled, compile_file
from schedc.errors import UserError
from schedc.ir.op import COMPUTE, Kind
from schedc.ir.plan import Action, Plan
from schedc.ir.spec import DDPSpec, FSDPSpec, Spec
from schedc.lang.diagnostics import CompileError, Diagnostic, count, render_all
from schedc.lang.params import describe_params
from schedc.lang.resolve import flag_place, range_error
from schedc.lang.resources import bundled_schedules, pipeline_schedules
from schedc.passes.memory import fmt_bytes, traffic
from schedc.passes.pipeline_memory import in_flight

HELP = "prove schedules legal; print a summary or a stage's text"

# (flag, the flag it needs, what it does): alone, it would be silently ignored
NEEDS = [("--rank", "--dump", "picks the rank whose graph, program or plan --dump prints")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="one schedule, or two to prove they agree (default: every bundled schedule, "
        "schedules/pipeline/ included)",
    )
    p.add_argument(
        "--dump",
        choices=["ast", "graph", "program", "plan", "pipeline"],
        help="print a stage's text form instead of the summary",
    )
    p.add_argument(
        "--rank",
        type=int,
        metavar="R",
        help="with --dump: the rank whose graph, program or plan to print (default: the one "
        "every rank without a `program ... on rank N` runs)",
    )
    add_override_args(p)


def run(args: argparse.Namespace) -> int:
    require(args, NEEDS)
    files = [Path(f) for f in args.files] or bundled_schedules() + pipeline_schedules()
    if args.dump and len(files) != 1 and args.files:
        raise UserError("--dump takes one file")
    ov = overrides(args)  # a bad flag is one error, not one per file
    errors: list[CompileError] = []
    compiled: list[Compiled] = []
    for f in files:
        try:
            c = compile_file(f, ov)
        except CompileError as e:
            errors.append(e)
            continue
        compiled.append(c)
        if args.rank is not None:
            _check_rank(args.rank, c)
        if c.warnings:  # bounded like errors: the first MAX_SHOWN, then a count
            print(render_all(list(c.warnings), c.source), file=sys.stderr)
        if args.dump:
            text = c.dump(args.dump, args.rank)
            print(text if len(files) == 1 else f"## {f}\n{text}")
        else:
            print(summary(c))
    if len(args.files) == 2 and len(compiled) == 2 and not args.dump:
        _compare(*compiled)
    if errors:
        for err in errors[:-1]:
            print(err.render(), file=sys.stderr)
        raise errors[-1]
    return 0


def _check_rank(rank: int, c: Compiled) -> None:
    """--rank names one of the schedule's ranks: a CompileError about the flag otherwise."""
    world = c.spec.world
    if (bad := range_error("rank", rank, 0, world - 1)) is not None:
        raise CompileError(
            [
                Diagnostic(
                    "value-range",
                    bad,
                    path=flag_place("rank", rank),
                    hint=f"{c.source.path} is a world-{world} schedule: ranks 0 .. {world - 1}",
                )
            ]
        )


def _compare(a: Compiled, b: Compiled) -> None:
    """Two schedules: whether they make the same update (passes/agree.py), and if not why."""
    from schedc.passes.agree import compare

    result = compare(a.spec, b.spec)
    ta, tb = result.tokens
    print(f"\n{a.source.path}: {ta:,} tokens per update")
    print(f"{b.source.path}: {tb:,} tokens per update")
    if not result.agree:
        raise CompileError(result.diagnostics, b.source)
    w = a.spec.loss_weight()
    same = (
        f"same model, same {a.spec.seqs:,} sequences each read once, every token "
        f"weighted {w.numerator}/{w.denominator} in the loss (1/k x 1/D x micro mean), "
        "same optimizer"
    )
    if result.numerics:  # the batch agrees; the rounding does not (passes/agree.py)
        print(
            f"agree on the batch: {same}: the same update in exact arithmetic; "
            f"numerics differ: {', '.join(result.numerics)} "
            f"({a.source.path} vs {b.source.path}), so the updates differ by rounding"
        )
    else:
        print(f"agree: {same}, same numerics: the same update")


def _head_lines(c: Compiled) -> list[str]:
    """The path, the model and the global batch: the summary's first lines for any schedule."""
    s, cfg = c.spec, c.spec.model
    return [
        f"{c.source.path}: ok",
        f"  model     {s.model_name}: {cfg.numel:,} params ({count(cfg.n_layer, 'layer')}, "
        f"{count(cfg.n_head, 'head')}, C={cfg.n_embd}, context {cfg.block_size}, "
        f"vocab {cfg.vocab_size})",
        f"  batch     {s.seqs:,} x {s.seq_len:,} = {count(s.tokens_per_step, 'token')} per update",
    ]


def pipeline_summary(c: Compiled) -> str:
    """A pipeline schedule's report: the split over dp, the stages on their ranks, the
    schedule and its simulated bubble per rank, the proof."""
    s, pp = c.spec, c.pipeline
    assert s.pipeline is not None and pp is not None
    ps = s.pipeline
    bubble = " ".join(f"{b:.1%}" for _, b in sorted(pp.bubble.items()))
    mbs = count(s.accum, "micro-batch", "micro-batches")
    lines = [
        *_head_lines(c),
        f"  split     dp {s.dp} x micro {s.micro} x {mbs} (the "
        f"{count(ps.degree, 'rank')} of a pipeline compute each micro-batch together)",
        f"  pipeline  {count(len(ps.stages), 'stage')}, {ps.schedule.value}, placement "
        f"{ps.placement.value}, {mbs}, dp {s.dp}{_replicas(s, ps)}; bubble per rank "
        f"{bubble} "
        f"(simulated at {pp.cost_words})",
        *(
            f"    {st.name:<6} {_ranks(pp.pipeline.rank_of(i), s.dp)}  {', '.join(st.layers)}"
            for i, st in enumerate(ps.stages)
        ),
        f"  numerics  {s.numerics.describe(s.sync)}",
        *_memory_lines(c),
        f"  proof     every rank's program proven: each send paired with one receive in FIFO "
        f"order, no deadlock under blocking rendezvous ({count(len(pp.programs), 'program')}, "
        "--dump pipeline prints them)",
        *([f"            {c.proof.line()}"] if c.proof is not None else []),
    ]
    return "\n".join(lines)


def _memory_lines(c: Compiled) -> list[str]:
    """Each pipeline rank's predicted peak, and the micro-batches it holds at once."""
    pp = c.pipeline
    assert pp is not None
    cells = [
        f"{fmt_bytes(m.peak)} ({in_flight(pp.programs[r])} in flight)"
        for r, m in sorted(pp.memory.items())
    ]
    budget = f" of {fmt_bytes(c.spec.memory)}" if c.spec.memory else ""
    return [f"  memory    peak per rank{budget}: {', '.join(cells)} (states, activations of "
            "the micro-batches in flight, transfers; passes/pipeline_memory.py)"]  # fmt: skip


def _replicas(s: Spec, ps) -> str:
    dp, units = s.dp, ps.units
    m = s.stage_mesh
    if units and m.replicate > 1:  # HSDP per stage
        return (
            f" (mesh {m} replicate x shard, rank = pp x {dp} + replicate x {m.shard} + shard; "
            f"HSDP per stage: {count(len(units), 'unit')} sharded over {m.shard} ranks, "
            "gathered once a step before the stage's first forward, gradients "
            f"reduce-scattered after its last backward, then all-reduced over {m.replicate} "
            f"ranks {m.shard} apart)"
        )
    if units:
        return (
            f" (rank = pp x {dp} + replica; FSDP per stage: {count(len(units), 'unit')} "
            f"sharded over the {dp} replicas, gathered once a step before the stage's first "
            "forward, gradients reduce-scattered after its last backward)"
        )
    if dp == 1:
        return ""
    said = "one bucket a stage"
    if ps.buckets:
        named = ", ".join(f"{b.name} in {ps.stages[b.stage].name}" for b in ps.buckets)
        said = (
            f"in {count(len(ps.buckets), 'bucket')}, each stage's in reverse layer order: {named}"
        )
    return (
        f" (rank = pp x {dp} + replica; each stage's gradients all-reduced over its {dp} "
        f"replicas after its last backward, {said})"
    )


def _ranks(pp_rank: int, dp: int) -> str:
    """The global ranks holding a pipeline rank's stages, pp-outermost (ir/spec.py)."""
    if dp == 1:
        return f"rank {pp_rank}"
    return "ranks " + ", ".join(str(pp_rank * dp + d) for d in range(dp))


def summary(c: Compiled) -> str:
    """`schedc check`'s report of one schedule: model, batch, strategy, streams, memory."""
    if c.pipeline is not None:
        return pipeline_summary(c)
    s, cfg = c.spec, c.spec.model
    plan = c.plan()
    lines = [
        *_head_lines(c),
        f"  split     world {s.world} x micro {s.micro} x {count(s.accum, 'micro-step')}"
        + (" (no_sync: only the last communicates)" if s.no_sync and s.accum > 1 else ""),
        *_strategy_lines(s, plan),
    ]
    if s.hsdp:
        lines += _mesh_lines(s, plan)
    n_ops = {st: 0 for st in plan.streams}
    for ins in plan.instrs:
        if ins.kind is Action.RUN:
            n_ops[ins.stream] += 1
    comm = ", ".join(f"{stn} {n}" for stn, n in n_ops.items())
    lines.append(f"  streams   ops: {comm}; {count(len(plan.producers), 'event')}")
    lines.append(f"  numerics  {s.numerics.describe(s.kind)}")
    if s.recompute:
        again = [layer for layer in cfg.layers if layer in s.recompute]
        lines.append(f"  recompute {', '.join(again)} (input kept; forward again before backward)")
    mem = ", ".join(f"{name} {fmt_bytes(v)}" for name, v in c.memory.rows() if v)
    budget = f" (budget {fmt_bytes(s.memory)})" if s.memory else ""
    lines.append(f"  memory    per rank{budget}: {mem}")
    if c.proof is not None:
        lines.append(f"  proof     {c.proof.line()}")
    return "\n".join(lines)


def _strategy_lines(s: Spec, plan: Plan) -> list[str]:
    """The strategy in a line, then a line per bucket or unit."""
    st, cfg = s.strategy, s.model
    if isinstance(st, DDPSpec):
        how = "explicit buckets"
        if st.cap:
            assert st.first is not None  # bucket_cap sets both
            how = f"bucket_cap {fmt_bytes(st.cap)}, first {fmt_bytes(st.first)}"
        head = (
            f"  strategy  DDP, {count(len(st.buckets), 'bucket')} ({how}), {_overlap(st, s, plan)}"
        )
        return [head] + [
            f"    {b.name:<6} {fmt_bytes(b.nbytes):>11}  {describe_params(cfg, b.params)}"
            for b in st.buckets
        ]
    if isinstance(st, FSDPSpec):
        head = (
            f"  strategy  {'HSDP' if s.hsdp else 'FSDP'}, {count(len(st.units), 'unit')}, "
            f"prefetch forward "
            f"{st.prefetch_forward} backward {st.prefetch_backward}, reshard_after_forward "
            f"{'on' if st.reshard_after_forward else 'off'}{_serialized(plan)}"
        )
        return [head] + [
            f"    {u.name:<6} {fmt_bytes(u.nbytes):>11}  {describe_params(cfg, u.params)}"
            + ("  (kept gathered)" if u.keep else "")
            for u in st.units
        ]
    return ["  strategy  one process: gradients added across micro-steps"]


def _mesh_lines(s: Spec, plan: Plan) -> list[str]:
    """HSDP's mesh, and the bytes each rank moves over each of its dimensions."""
    m = s.mesh
    moved = traffic(s, plan)
    return [
        f"  mesh      {m} (replicate x shard): units sharded over {m.shard} consecutive "
        f"ranks, gradient shards all-reduced over {m.replicate} ranks {m.shard} apart",
        "  traffic   per rank per step: "
        + "; ".join(
            f"{dim} {', '.join(f'{k} {fmt_bytes(v)}' for k, v in per.items())}"
            for dim, per in moved.items()
        ),
    ]


def _overlap(st: DDPSpec, s: Spec, plan: Plan) -> str:
    """Whether all-reduce overlaps backward, as the plan places it, not as `overlap` reads:
    `stream allreduce = compute` (or a program) puts it on the compute stream, after the
    backward that precedes it there, whatever `overlap` says."""
    streams = [
        i.stream
        for i in plan.instrs
        if i.kind is Action.RUN and i.op is not None and i.op.kind is Kind.ALLREDUCE
    ]
    serial = streams.count(COMPUTE)
    if not serial:
        return "overlap on"
    if serial < len(streams):
        return (
            f"overlap for {len(streams) - serial} of {count(len(streams), 'all-reduce')} "
            f"({serial} on the compute stream)"
        )
    if not st.overlap:
        return "overlap off"
    if s.streams[Kind.ALLREDUCE] == COMPUTE:
        return "no overlap: `stream allreduce = compute` puts every all-reduce on compute"
    return "no overlap: every all-reduce is written on the compute stream"


def _serialized(plan: Plan) -> str:
    """FSDP's collectives that run on the compute stream, where nothing overlaps them."""
    kinds = [
        k
        for k in (Kind.ALLGATHER, Kind.REDUCESCATTER)
        if any(op.kind is k for op in plan.collectives(COMPUTE))
    ]
    if not kinds:
        return ""
    names = " and ".join(
        {"allgather": "all-gather", "reducescatter": "reduce-scatter"}[k] for k in kinds
    )
    return f"; {names} on the compute stream (no overlap)"

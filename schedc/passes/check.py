"""The checking pass: prove the schedule graph legal, or say exactly where it is not.

Rules, each with its code (errors.CODES):

* every op the step needs is placed once; nothing else is   [missing-op] [duplicate-op]
  [unexpected-op] [nosync-comm]
* the run graph is acyclic; no op waits on its own stream's future   [cycle] [deadlock]
* every need holds in the run graph: activations and saved tensors [out-of-order],
  cross-stream needs by an event [missing-event], reductions after the last gradient
  write [early-reduce], the optimizer after every reduction [optimizer-wait]
* a recompute is complete before its layer's backward [recompute-late] (which releases
  what the layer kept), and is of a layer declared `recompute`, whose forward kept its
  input: any other forward saved activations and freed its input [recompute-freed]
* every rank issues the same collectives in the same order on each stream   [spmd]

and the lifetime rules of passes/buffers.py, the plan's effects read with vector clocks: a
unit's parameters read only while gathered [use-after-free] (a recompute's too
[recompute-gather]), the predicted peak within the declared budget [memory-budget], and one
invariant of every lowered plan, which no schedule can break (a broken one is a bug in
schedc, reported as an internal error with its code): every buffer an op reads that another
stream allocated is kept alive on the reading stream   [keep-alive]

Rules about what the schedule declares (names, coverage, batch arithmetic, tied weights,
streams of compute ops) are judged earlier, in lang/resolve/.
"""

from __future__ import annotations

from collections.abc import Iterator

import networkx as nx

from schedc.ir.bound import Bound
from schedc.ir.op import REDUCTIONS, Kind, Op, Phase
from schedc.ir.plan import Plan
from schedc.ir.source import Span
from schedc.ir.spec import Spec, Strategy
from schedc.lang.diagnostics import Diagnostics, Note
from schedc.passes.buffers import Finding, gathered_findings, memory_budget, plan_invariants
from schedc.passes.graph import ScheduleGraph
from schedc.passes.memory import MemoryReport
from schedc.passes.payloads import Need, Sync, said
from schedc.passes.prove import Proof, prove
from schedc.passes.prove_rank import Refuted


def check_graphs(spec: Spec, graphs: dict[int | None, ScheduleGraph], diag: Diagnostics) -> bool:
    """The rules of each rank's graph; whether every graph can be lowered to a plan."""
    lowerable = True
    for sg in graphs.values():
        ok = _placement(sg, diag)
        ok = _acyclic(sg, diag) and ok
        if ok:
            _needs(sg, diag)
        lowerable = lowerable and ok
    return lowerable


def check_plans(
    spec: Spec,
    graphs: dict[int | None, ScheduleGraph],
    plans: dict[int | None, Plan],
    memory: dict[int | None, MemoryReport],
    diag: Diagnostics,
) -> None:
    """The rules across ranks' plans (collective order, waits in a circle) and the budget,
    after the plans' own invariants (what the lowering must have made: a compiler bug)."""
    for plan in plans.values():
        plan_invariants(spec, plan)
    if _spmd(spec, graphs, plans, diag) and len(graphs) > 1:
        _across_ranks(spec, graphs, diag)
    if spec.memory is not None:
        for rank, report in memory.items():
            if rank is None and _everyone_has_a_program(spec, graphs):
                continue  # no rank runs the common plan
            memory_budget(spec, report, diag, rank)


def check_proof(spec: Spec, bounds: list[Bound], diag: Diagnostics) -> Proof | None:
    """The proof (passes/prove.py) over every rank's bound plan; a refutation is an error at
    the program or strategy it concerns, with the rank's plan around the instruction."""
    try:
        return prove(spec, bounds)
    except Refuted as e:
        plan = bounds[e.rank].plan
        notes: tuple[Note, ...] = ()
        if e.index is not None:
            lines = plan.render(mark=e.index).splitlines()[1:]
            window = lines[max(0, e.index - 2) : e.index + 3]
            notes = (Note(f"rank {e.rank}'s plan:\n" + "\n".join(window)),)
        diag.error(
            "proof",
            e.message,
            _proof_span(spec, e.rank),
            hint="the lowered plans do not compute one process's update: a compiler bug, "
            "unless a written program made them",
            notes=notes,
        )
        return None


def _proof_span(spec: Spec, rank: int) -> Span | None:
    if spec.pipeline is not None:  # the plans bound from the pipeline block's programs
        return spec.pipeline.where.get("schedule", spec.pipeline.span)
    for p in spec.programs:
        if p.rank == rank:
            return p.span
    for p in spec.programs:
        if p.rank is None:
            return p.span
    return spec.where.get(spec.kind.value) or spec.where.get("world")


def _everyone_has_a_program(spec: Spec, graphs) -> bool:
    return len([r for r in graphs if r is not None]) == spec.world


def _program_span(sg: ScheduleGraph, stream: str | None) -> Span | None:
    for p in sg.spec.programs:
        if p.stream == stream and p.rank in (None, sg.rank):
            return p.span
    return None


def _who(sg: ScheduleGraph) -> str:
    return "" if sg.rank is None else f" on rank {sg.rank}"


# -- placement ----------------------------------------------------------------------------------


def _placement(sg: ScheduleGraph, diag: Diagnostics) -> bool:
    spec, ok = sg.spec, True
    for op in sg.g:
        d = sg.node(op)
        if d.again is not None:
            diag.error(
                "duplicate-op",
                f"{op} is written twice{_who(sg)}",
                d.again,
                hint="each op runs once per step; delete one",
                notes=(Note("first written here", d.span),),
            )
            ok = False
        if not d.placed and d.required:
            where = spec.streams[op.kind]
            diag.error(
                "missing-op",
                _missing_message(sg, op),
                _program_span(sg, where) or d.span,
                hint=f"add `{op}` to `program {where}` (with the `after` it needs)",
            )
            ok = False
        if not d.placed and not d.required:
            # named only by an `after`: no program runs it, so nothing can wait for it
            diag.error(
                "unexpected-op",
                f"this waits for {op}, which is not part of this schedule{_why_not(sg, op)}",
                d.span,
                hint="`schedc check --dump program` prints the ops it has",
            )
            ok = False
        if d.placed and not d.required:
            if op.kind is Kind.RECOMPUTE and op.target not in spec.recompute:
                diag.error(
                    "recompute-freed",
                    f"{op} reruns {op.target}'s forward from its input, but {op.target} does "
                    f"not recompute: its forward saved activations and freed its input",
                    d.span,
                    hint=f"declare `recompute {op.target}` (a top-level statement), or drop {op}",
                )
            elif op.is_collective and spec.no_sync and not spec.communicates(op.mb):
                diag.error(
                    "nosync-comm",
                    f"{op} communicates in micro-step {op.mb}, but no_sync "
                    f"keeps gradients local until the last (mb{spec.accum - 1})",
                    d.span,
                    hint=f"move it to mb{spec.accum - 1}, or set `no_sync off`",
                )
            else:
                diag.error(
                    "unexpected-op",
                    f"{op} is not part of this schedule{_why_not(sg, op)}",
                    d.span,
                    hint="`schedc check --dump program` prints the ops it has",
                )
            ok = False
    return ok


def _missing_message(sg: ScheduleGraph, op: Op) -> str:
    who = _who(sg)
    if op.kind is Kind.ALLREDUCE and sg.spec.hsdp:
        return (
            f"unit '{op.target}' is never all-reduced over the replicate dimension in "
            f"micro-step {op.mb}{who}"
        )
    if op.kind is Kind.ALLREDUCE:
        return f"bucket '{op.target}' is never all-reduced in micro-step {op.mb}{who}"
    if op.kind is Kind.REDUCESCATTER:
        return f"unit '{op.target}' is never reduce-scattered in micro-step {op.mb}{who}"
    if op.kind is Kind.ALLGATHER and op.phase is not None:
        return f"unit '{op.target}' is never gathered for its {op.phase.value} in mb{op.mb}{who}"
    return f"{op} is missing from the written program{who}"


def _why_not(sg: ScheduleGraph, op: Op) -> str:
    spec = sg.spec
    if op.is_collective and spec.no_sync and not spec.communicates(op.mb):
        return f" (no_sync keeps mb{op.mb} local; only mb{spec.accum - 1} communicates)"
    if (
        op.kind is Kind.ALLGATHER
        and op.phase is Phase.BWD
        and spec.kind is Strategy.FSDP
        and not spec.fsdp.reshard_after_forward
    ):
        return f" (reshard_after_forward is off, so {op.target} stays gathered for backward)"
    return ""


# -- the run graph ------------------------------------------------------------------------------


def _acyclic(sg: ScheduleGraph, diag: Diagnostics) -> bool:
    ok = True
    for u, v, d in sg.deps():
        if d.sync is Sync.AFTER and sg.node(u).pos >= sg.node(v).pos:
            diag.error(
                "deadlock",
                f"{v} waits for {u}, which comes later on stream '{sg.node(v).stream}'{_who(sg)}",
                d.span or sg.node(v).span,
                hint=f"a stream runs in order: move {u} before {v}, or drop the wait",
            )
            ok = False
    if not ok:
        return False
    runs = sg.syncs()
    try:
        cycle = nx.find_cycle(runs)
    except nx.NetworkXNoCycle:
        return True
    path = [u for u, _ in cycle] + [cycle[0][0]]
    # point at a wait the file wrote (an `after`) if there is one, else at an event
    written = [(u, v) for u, v in cycle if sg.dep(u, v).span is not None]
    events = [(u, v) for u, v in cycle if sg.dep(u, v).sync is Sync.EVENT]
    u, v = (written or events or cycle)[0]
    diag.error(
        "cycle",
        f"the schedule waits in a circle{_who(sg)}: " + " -> ".join(str(op) for op in path),
        sg.dep(u, v).span or sg.node(v).span,
        hint="each arrow is program order or an `after`; break one of the waits",
    )
    return False


def _needs(sg: ScheduleGraph, diag: Diagnostics) -> None:
    unmet: dict[tuple[Op, str], tuple[int, Finding]] = {}
    for found in [*_unmet_needs(sg), *gathered_findings(sg)]:
        # one finding per op and rule: the producer that comes last is the one to wait for
        seq = sg.node(found.cause).seq or 0
        key = (found.op, found.code)
        if key not in unmet or unmet[key][0] < seq:
            unmet[key] = (seq, found)
    for _, found in unmet.values():
        diag.error(found.code, found.message + _who(sg), sg.node(found.op).span, hint=found.hint)


# what gathered parameters need (their gather first, their free last) the lifetime rules judge
_LIFETIMES = {Need.PARAMS, Need.LAST_USE}


def _unmet_needs(sg: ScheduleGraph) -> Iterator[Finding]:
    for u, v, whys in sg.needs():
        if not sg.node(u).placed or not sg.node(v).placed:
            continue  # reported as missing
        if set(whys) <= _LIFETIMES or sg.ordered(u, v):
            continue
        code, msg, hint = _unmet(sg, u, v, whys)
        yield Finding(v, code, u, msg, hint)


def _unmet(sg: ScheduleGraph, u: Op, v: Op, whys: list[Need]) -> tuple[str, str, str]:
    su, sv = sg.node(u).stream, sg.node(v).stream
    cross = su != sv
    wait = f"write `{v} after {u}`"
    if v.kind is Kind.STEP and Need.UPDATE in whys:
        return (
            "optimizer-wait",
            f"the optimizer step does not wait for {u}",
            f"{wait}: the update must read reduced gradients",
        )
    if v.kind in REDUCTIONS and Need.GRADS in whys:
        tied = (
            " (the tied wte/lm_head weight gets its last gradient from bwd[embed])"
            if (u.target == "embed")
            else ""
        )
        return (
            "early-reduce",
            f"{v} can start before {u} has written its gradients{tied}",
            wait if cross else f"place {v} after {u}",
        )
    if v.kind is Kind.BWD and u.kind is Kind.RECOMPUTE:
        return (
            "recompute-late",
            f"{v} reads the activations {u} rebuilds, but can start before it",
            f"place {u} right before {v}",
        )
    if cross:
        return (
            "missing-event",
            f"{v} on stream '{sv}' needs {u} on stream '{su}' "
            f"({said(whys)}) but nothing makes it wait",
            wait,
        )
    return (
        "out-of-order",
        f"{v} comes before {u} on stream '{sv}', but needs its {said(whys)}",
        f"place {u} first",
    )


# -- ranks and memory ---------------------------------------------------------------------------


def _spmd(spec: Spec, graphs, plans: dict[int | None, Plan], diag: Diagnostics) -> bool:
    """Every rank of a group must issue the group's collectives in the same order, on each
    stream: one group per mesh dimension (the world, for flat DDP and FSDP; under HSDP a
    rank's shard group and its replicate group, each compared among its own members)."""
    ok = True
    mesh, hsdp = spec.mesh, spec.hsdp
    for dim in spec.dims():
        for members in mesh.groups(dim):
            # compare with the members that run the common plan; when every member has
            # programs of its own, nobody there runs it, so compare with the lowest one
            own = [r for r in members if r in plans]
            base_rank = None if len(own) < len(members) else own[0]
            base = plans[base_rank]
            if base_rank is not None:
                others = f"rank {base_rank} issues"
            else:
                others = "the other ranks" + (f" of its {dim} group" if hsdp else "") + " issue"
            over = f" over the {dim} dimension" if hsdp else ""
            for rank in own:
                if rank == base_rank:
                    continue
                if not _same_collectives(
                    spec, graphs[rank], base, plans[rank], dim, others, over, diag
                ):
                    ok = False
    return ok


def _same_collectives(spec, sg, base: Plan, plan: Plan, dim, others, over, diag) -> bool:
    rank = sg.rank
    for stream in sorted(set(base.streams) | set(plan.streams)):
        a = [op for op in base.collectives(stream) if spec.dim_of(op) == dim]
        b = [op for op in plan.collectives(stream) if spec.dim_of(op) == dim]
        if a == b:
            continue
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        theirs = str(b[i]) if i < len(b) else "nothing"
        ours = str(a[i]) if i < len(a) else "nothing"
        # point at the rank's first differing collective if its program writes it
        written = i < len(b) and sg.stream_of(b[i]) in sg.written
        span = (
            sg.span_of(b[i]) if written else next(p.span for p in spec.programs if p.rank == rank)
        )
        diag.error(
            "spmd",
            f"rank {rank} issues {theirs} as collective #{i + 1}{over} on stream "
            f"'{stream}', where {others} {ours}",
            span,
            hint="collectives match by issue order; a mismatch hangs gloo and NCCL. "
            "Give every rank the same collective order",
        )
        return False
    return True


def _across_ranks(spec: Spec, graphs, diag: Diagnostics) -> None:
    """The ranks' run graphs must be acyclic together, not only one by one.

    A collective completes on every rank at once, so it is one node shared by all ranks;
    with collectives on two streams, rank 0 may wait for a gather before a reduce-scatter
    while rank 1 waits the other way round: each rank's graph is acyclic, each stream's
    order agrees, and yet the job hangs. Collectives are matched by (stream, mesh dimension,
    group, position among that stream's collectives of the dimension), which _spmd has
    proven the same on every member of the group.
    """
    labels = [r for r in graphs if r is not None]
    if spec.hsdp:  # a collective is shared by its group only: every rank stands for itself
        labels = list(range(spec.world))
    elif not _everyone_has_a_program(spec, graphs):
        labels.insert(0, None)
    mesh = spec.mesh
    together = nx.DiGraph()
    ranks: dict[tuple, list[int | None]] = {}  # edge -> the ranks whose waits make it
    for label in labels:
        sg = graphs.get(label, graphs[None])
        index = {}
        for stream, ops in sg.programs.items():
            for dim in spec.dims():
                group = mesh.members(label or 0, dim) if spec.hsdp else ()
                coll = [op for op in ops if op.is_collective and spec.dim_of(op) == dim]
                index.update({op: (stream, dim, group, i) for i, op in enumerate(coll)})

        def key(op, label=label, index=index):
            return ("all", op, index[op]) if op.is_collective else (label, op)

        runs = sg.syncs()
        together.add_nodes_from(key(op) for op in runs)
        for u, v in runs.edges:
            together.add_edge(key(u), key(v))
            ranks.setdefault((key(u), key(v)), []).append(label)
    try:
        cycle = nx.find_cycle(together)
    except nx.NetworkXNoCycle:
        return

    def who(label) -> str:
        return "the other ranks" if label is None else f"rank {label}"

    steps = [f"{v[1]} after {u[1]} on {who(ranks[u, v][0])}" for u, v in cycle]
    rank = next((r for u, v in cycle for r in ranks[u, v] if r is not None), labels[-1])
    span = next(p.span for p in spec.programs if p.rank == rank)
    diag.error(
        "spmd",
        "the ranks wait for each other in a circle: " + "; ".join(steps),
        span,
        hint="a collective finishes on every rank at once; order the waits the same "
        "way on every rank",
    )

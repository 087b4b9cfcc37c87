"""Break one rule of a valid schedule: the checker must reject it with that rule's code.

Every case starts from a generated valid schedule (tests/strategies.py) and applies one
rule-breaking mutation, to what the schedule declares (drop a layer from coverage, add
it twice, break the batch arithmetic, ...) or to its written programs: the text
`schedc check --dump program` prints (`schedc.passes.dump.dump_program`), pasted back and
edited (swap two collectives on rank 1, make a reduction wait on an earlier backward,
free a unit before its last reader, ...). `compile_text` must raise CompileError whose
codes include the expected one, so nothing ever runs. The unbroken version of each
mutant (the "control") must compile: the mutation, not the starting point, is what
the checker rejects.

Where a mutation could be benign on some schedules (dropping a wait that another wait
already implies), the expected code is decided by a small independent oracle, the run
graph built here from the written programs (program order plus `after` edges), never by
asking the checker.

The end of the file fuzzes the parser with edits of generated schedules: any edit gives
a compiled schedule or located diagnostics, never a traceback, within a time bound.
(Random bytes and random token streams are tests/lang/test_fuzz.py's.)
"""

from __future__ import annotations

import itertools
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import networkx as nx
import pytest
from hypothesis import Phase, assume, given, note, settings
from hypothesis import strategies as st

from schedc.compiler import compile_text
from schedc.ir.op import Kind, Op
from schedc.lang.diagnostics import CODES, CompileError
from tests.strategies import (
    DDP,
    FSDP,
    TIED,
    Case,
    Line,
    Programs,
    Unit,
    cases,
    copy,
    examples,
    program_lines,
    programs_of,
    run_graph,
    tally,
)

# the count test reads this process's tally: under pytest-xdist every test here shares a worker
pytestmark = pytest.mark.xdist_group("mutations")


def find(progs: Programs, op: str) -> tuple[str, int]:
    for s, lines in progs.items():
        for i, x in enumerate(lines):
            if x.op == op:
                return s, i
    raise KeyError(op)


def kind(op: str) -> Kind:
    return Op.parse(op).kind


def is_reduction(op: str) -> bool:
    return kind(op) in (Kind.ALLREDUCE, Kind.REDUCESCATTER)


@dataclass(frozen=True)
class Mutant:
    code: str  # the rule broken
    text: str  # the broken schedule
    what: str  # the mutation, in words
    control: str  # the same schedule unbroken: it compiles


def declared(case: Case, code: str, what: str, **changes) -> Mutant:
    """A mutation of what the schedule declares (a changed Case)."""
    return Mutant(code, case.with_(**changes).text(), what, case.text())


def pick(draw, items):
    items = list(items)
    assume(items)
    return items[draw(st.integers(0, len(items) - 1))]


def groups(layout) -> list[list[str]]:
    if isinstance(layout, DDP):
        return [list(b) for b in layout.buckets]
    return [list(u.items) for u in layout.units]


def with_groups(layout, gs: list[list[str]]):
    """The layout with new group contents (a group emptied disappears)."""
    if isinstance(layout, DDP):
        return replace(layout, buckets=tuple(tuple(g) for g in gs if g))
    units = tuple(replace(u, items=tuple(g)) for u, g in zip(layout.units, gs) if g)
    return replace(layout, units=units)


def layer_set(case: Case, items) -> set[str]:
    """The layers that read a group's parameters."""
    cfg = case.cfg
    params = set()
    for it in items:
        params |= {p.name for p in cfg.layer_params(it)} if it in cfg.layers else {it}
    return {layer for p in params for layer in cfg.users(p)}


# -- coverage and names -----------------------------------------------------------------------


@st.composite
def uncovered(draw):
    case = draw(cases(max_k=4, explicit=True))
    gs = groups(case.layout)
    i = draw(st.integers(0, len(gs) - 1))
    item = gs[i].pop(draw(st.integers(0, len(gs[i]) - 1)))
    return declared(
        case, "uncovered", f"drop {item} from its group", layout=with_groups(case.layout, gs)
    )


@st.composite
def double_cover(draw):
    case = draw(cases(max_k=4, explicit=True))
    gs = groups(case.layout)
    i, j = (draw(st.integers(0, len(gs) - 1)) for _ in range(2))
    item = pick(draw, gs[i])
    gs[j].append(item)
    return declared(
        case,
        "double-cover",
        f"add {item} to group {j + 1} too",
        layout=with_groups(case.layout, gs),
    )


@st.composite
def unknown_layer(draw):
    case = draw(cases(max_k=4, explicit=True))
    gs = groups(case.layout)
    past = f"h.{case.n_layer + draw(st.integers(0, 9))}"
    name, code = draw(
        st.sampled_from(
            [
                (past, "layer-range"),
                (f"h.0 .. {past}", "layer-range"),
                ("lm_head", "unknown-name"),
                ("wte", "unknown-name"),
                ("ln_f", "unknown-name"),
                ("h.0.attn.c_atn.weight", "unknown-name"),
                ("blocks", "unknown-name"),
            ]
        )
    )
    gs[draw(st.integers(0, len(gs) - 1))].append(name)
    return declared(case, code, f"name {name}", layout=with_groups(case.layout, gs))


@st.composite
def tied_param(draw):
    """The tied weight in a unit that is not kept and holds other layers."""
    case = draw(cases(kinds=("fsdp",), max_k=4))
    units = list(case.layout.units)
    mode = units[0].name if units[0].name in ("tied", "root") else "one"
    if mode == "root":  # embed and head no longer kept gathered together
        units[0] = replace(units[0], keep=False)
        what = "drop `keep` from the root unit (embed, head)"
    elif mode == "one":  # split off embed (with wte): it no longer spans to head
        cfg = case.cfg
        units = [Unit("u1", ("embed",)), Unit("u2", tuple(cfg.layers[1:]))]
        what = "split the one unit into embed and the rest"
    else:  # move wte.weight into a unit that does not span every block
        blocks = {x for x in case.cfg.layers if x.startswith("h.")}
        targets = [
            i
            for i, u in enumerate(units[1:], 1)
            if not u.keep and not blocks <= layer_set(case, u.items)
        ]
        i = pick(draw, targets)
        units[i] = replace(units[i], items=units[i].items + (TIED,))
        units = units[1:]
        what = f"move {TIED} into unit {units[i - 1].name}"
    return declared(case, "tied-param", what, layout=replace(case.layout, units=tuple(units)))


@st.composite
def unit_contiguous(draw):
    """A unit (not kept, not holding the tied weight) read by layers that are not adjacent."""
    case = draw(cases(kinds=("fsdp",), max_k=4))
    cfg, units = case.cfg, list(case.layout.units)
    index = {layer: i for i, layer in enumerate(cfg.layers)}
    moves = []
    for i, u in enumerate(units):
        if u.keep or TIED in u.items:
            continue
        mine = [index[x] for x in layer_set(case, u.items)]
        for j, v in enumerate(units):
            if j == i or v.keep or TIED in v.items:
                continue
            for item in v.items:
                if item in index and min(abs(index[item] - m) for m in mine) >= 2:
                    moves.append((i, j, item))
    i, j, item = pick(draw, moves)
    gs = groups(case.layout)
    gs[j].remove(item)
    gs[i].append(item)
    return declared(
        case,
        "unit-contiguous",
        f"move {item} into unit {units[i].name}",
        layout=with_groups(case.layout, gs),
    )


# -- batch arithmetic and settings ---------------------------------------------------------------


def edit_line(case: Case, prefix: str, new: str | None) -> str:
    """The case's text with the line starting with `prefix` replaced (or dropped)."""
    lines = case.lines()
    i = next(k for k, x in enumerate(lines) if x.startswith(prefix))
    lines[i : i + 1] = [] if new is None else [new]
    return "\n".join(lines) + "\n"


@st.composite
def batch_arithmetic(draw):
    case = draw(cases(max_k=4)).with_(stated="both")
    d = draw(st.integers(1, 3))
    which = draw(st.sampled_from(["batch", "micro", "accumulate", "world"]))
    value = {"batch": case.seqs, "micro": case.micro, "accumulate": case.k, "world": case.world}[
        which
    ]
    new = value + d if value - d < 1 or draw(st.booleans()) else value - d
    line = f"batch {new} x {case.seq_len}" if which == "batch" else f"{which} {new}"
    return Mutant(
        "batch-arithmetic",
        edit_line(case, which + " ", line),
        f"{which} {value} -> {new}",
        case.text(),
    )


@st.composite
def context_length(draw):
    case = draw(cases(max_k=4))
    block = case.cfg.block_size
    if draw(st.booleans()):
        tokens = block + draw(st.integers(1, 2 * block))
        return Mutant(
            "context-length",
            edit_line(case, "batch ", f"batch {case.seqs} x {tokens}"),
            f"sequences of {tokens} tokens",
            case.text(),
        )
    small = draw(st.integers(1, case.seq_len - 1))
    line = f"model nano {{ n_layer = {case.n_layer}  block = {small} }}"
    return Mutant("context-length", edit_line(case, "model ", line), f"block {small}", case.text())


@st.composite
def value_range(draw):
    case = draw(cases(max_k=4))
    options = [("world ", "world 0"), ("seed ", "seed -1"), ("batch ", f"batch 0 x {case.seq_len}")]
    if case.stated != "accumulate":
        options.append(("micro ", "micro 0"))
    if isinstance(case.layout, FSDP):
        options.append(("  prefetch forward", f"  prefetch forward {65 + draw(st.integers(0, 9))}"))
    if isinstance(case.layout, DDP) and case.layout.cap:
        options.append(("  bucket_cap", "  bucket_cap 0 KiB"))
    prefix, line = pick(draw, options)
    return Mutant("value-range", edit_line(case, prefix, line), line.strip(), case.text())


@st.composite
def unknown_setting(draw):
    case = draw(cases(max_k=4))
    prefix, line = draw(
        st.sampled_from(
            [
                ("model ", f"model nano {{ n_layer = {case.n_layer}  n_layers = 2 }}"),
                ("optimizer ", "optimizer adamw { lr = 1e-3  warmup = 1  clip = 1  wd = 0.1 }"),
            ]
        )
    )
    return Mutant("unknown-setting", edit_line(case, prefix, line), line, case.text())


@st.composite
def missing_setting(draw):
    case = draw(cases(max_k=4))
    which = draw(st.sampled_from(["model ", "world ", "batch ", "micro/accumulate"]))
    if which == "micro/accumulate":
        text = "".join(
            x + "\n" for x in case.lines() if not x.startswith(("micro ", "accumulate "))
        )
    else:
        text = edit_line(case, which, None)
    return Mutant("missing-setting", text, f"no {which.strip()}", case.text())


@st.composite
def duplicate(draw):
    case = draw(cases(max_k=4))
    line = pick(
        draw, [x for x in case.lines() if x.startswith(("world", "seed", "batch", "model"))]
    )
    return declared(case, "duplicate", f"state `{line}` twice", extra=(line,))


@st.composite
def conflict(draw):
    case = draw(cases(max_k=4))
    if isinstance(case.layout, DDP) and not case.layout.overlap and draw(st.booleans()):
        return declared(
            case, "conflict", "overlap off, all-reduce on comm", extra=("stream allreduce = comm",)
        )
    other = (
        "fsdp { unit all = embed .. head }"
        if isinstance(case.layout, DDP)
        else "ddp { bucket b = head .. embed }"
    )
    return declared(case, "conflict", "a ddp and an fsdp block", extra=(other,))


@st.composite
def compute_stream(draw):
    case = draw(cases(max_k=3))
    k = draw(st.sampled_from(["fwd", "bwd", "free"]))
    return declared(
        case, "compute-stream", f"{k} on the comm stream", extra=(f"stream {k} = comm",)
    )


@st.composite
def memory_budget(draw):
    """A budget one byte under the predicted peak (at the peak itself it compiles); for
    FSDP with prefetch, also: the budget that fits prefetch 0 is exceeded by the prefetch."""
    case = draw(cases(max_k=4))
    peak = compile_text(case.text()).memory.peak
    fs = case.layout
    if isinstance(fs, FSDP) and fs.prefetch != (0, 0) and draw(st.booleans()):
        lean = case.with_(layout=replace(fs, prefetch=(0, 0)))
        budget = compile_text(lean.text()).memory.peak
        if budget < peak:
            line = f"memory {budget} B"
            return Mutant(
                "memory-budget",
                case.with_(extra=(line,)).text(),
                f"prefetch {fs.prefetch} past the budget that fits prefetch 0",
                lean.with_(extra=(line,)).text(),
            )
    return Mutant(
        "memory-budget",
        case.with_(extra=(f"memory {peak - 1} B",)).text(),
        f"memory {peak - 1} B, one under the peak",
        case.with_(extra=(f"memory {peak} B",)).text(),
    )


# -- written programs ---------------------------------------------------------------------------


@st.composite
def with_programs(draw, **kw):
    case = draw(cases(max_k=3, **kw))
    return case, programs_of(case.text())


def collectives(progs: Programs, stream: str) -> list[int]:
    return [i for i, x in enumerate(progs[stream]) if Op.parse(x.op).is_collective]


@st.composite
def spmd(draw):
    """One rank issues two neighbouring collectives of a stream the other way round: rank 1
    alone writes its program, or every rank writes one and any rank (0 too) swaps."""
    case, progs = draw(with_programs(worlds=(2, 3, 4)))
    needs = nx.DiGraph()
    for u, v, _ in compile_text(case.text()).graph().needs():
        needs.add_edge(str(u), str(v))
    swaps = []
    for s in progs:
        pos = collectives(progs, s)
        for a, b in itertools.pairwise(pos):
            new = copy(progs)
            new[s][a], new[s][b] = new[s][b], new[s][a]
            # acyclic even with every need as a wait, so the rank's graph has no cycle
            g = nx.compose(run_graph({t: [Line(x.op, []) for x in new[t]] for t in new}), needs)
            if nx.is_directed_acyclic_graph(g):
                swaps.append((s, a, b, new))
    s, a, b, new = pick(draw, swaps)
    if draw(st.booleans()):
        rank, ranks = 1, [1]
    else:
        rank, ranks = draw(st.integers(0, case.world - 1)), list(range(case.world))
    mutant = [x for r in ranks for x in program_lines({s: (new if r == rank else progs)[s]}, r)]
    control = [x for r in ranks for x in program_lines({s: progs[s]}, r)]
    return Mutant(
        "spmd",
        case.with_(extra=tuple(mutant)).text(),
        f"rank {rank} swaps {progs[s][a].op} and {progs[s][b].op}"
        + (" (every rank writes its program)" if len(ranks) > 1 else ""),
        case.with_(extra=tuple(control)).text(),
    )


def _written(case: Case, base: Programs, new: Programs, code: str, what: str) -> Mutant:
    return Mutant(
        code,
        case.with_(extra=program_lines(new)).text(),
        what,
        case.with_(extra=program_lines(base)).text(),
    )


@st.composite
def early_reduce(draw):
    """A reduction made to wait for an op before its last gradient's backward (or, on the
    compute stream, placed before that backward)."""
    case, progs = draw(with_programs())
    new = copy(progs)
    choices = []
    for s, lines in progs.items():
        for i, x in enumerate(lines):
            if not is_reduction(x.op):
                continue
            for w in x.after:
                if kind(w) is Kind.BWD:
                    choices.append(("wait", s, i, w))
            if s == "compute":  # overlap off: right after the backward that completes it
                j = i - 1
                while j >= 0 and kind(lines[j].op) is not Kind.BWD:
                    j -= 1
                if j >= 0 and j == i - 1:
                    choices.append(("place", s, i, lines[j].op))
    how, s, i, w = pick(draw, choices)
    x = new[s][i]
    if how == "wait":
        ws, wi = find(progs, w)
        earlier = progs[ws][wi - 1].op if wi else None
        assume(earlier is not None)
        x.after = [earlier if a == w else a for a in x.after]
        what = f"{x.op} after {earlier} instead of {w}"
    else:
        new[s].insert(i - 1, new[s].pop(i))
        what = f"{x.op} placed before {w}"
    return _written(case, progs, new, "early-reduce", what)


@st.composite
def use_after_free(draw):
    """A free moved to just before the last op that reads its unit; or, with gathers on the
    compute stream, a gather moved to just after the first op that reads its unit."""
    case = draw(cases(kinds=("fsdp",), max_k=3))
    late_gather = draw(st.booleans())
    if late_gather:
        case = case.with_(layout=replace(case.layout, streams=(("allgather", "compute"),)))
    progs = programs_of(case.text())
    units = {u.name: set(u.layers) for u in compile_text(case.text()).spec.strategy.units}
    compute = progs["compute"]

    def reads(j: int, unit: str) -> bool:
        op = Op.parse(compute[j].op)
        return op.kind in (Kind.FWD, Kind.BWD) and op.target in units[unit]

    moves = []
    for i, x in enumerate(compute):
        op = Op.parse(x.op)
        if op.kind is Kind.FREE and not late_gather:
            moves.append((i, max(j for j in range(i) if reads(j, op.target))))
        elif op.kind is Kind.ALLGATHER and late_gather:
            moves.append((i, min(j for j in range(i + 1, len(compute)) if reads(j, op.target))))
    i, j = pick(draw, moves)
    new = copy(progs)
    new["compute"].insert(j, new["compute"].pop(i))
    where = "before" if j < i else "after"
    return _written(
        case, progs, new, "use-after-free", f"{compute[i].op} moved {where} {compute[j].op}"
    )


@st.composite
def nosync_comm(draw):
    case, progs = draw(with_programs(no_sync=True, min_k=2))
    spec = compile_text(case.text()).spec
    if isinstance(case.layout, DDP):
        op = f"allreduce[{pick(draw, [b.name for b in spec.strategy.buckets])}]@mb0"
    else:
        op = f"reducescatter[{pick(draw, [u.name for u in spec.strategy.units])}]@mb0"
    stream = spec.streams[Op.parse(op).kind]
    new = copy(progs)
    if stream == "compute":
        at = (
            max(
                i
                for i, x in enumerate(new["compute"])
                if x.op.startswith("bwd[") and x.op.endswith("@mb0")
            )
            + 1
        )
    else:
        at = 0
    new.setdefault(stream, []).insert(at, Line(op, []))
    return _written(case, progs, new, "nosync-comm", f"{op} in no_sync micro-step 0")


@st.composite
def optimizer_wait(draw):
    case, progs = draw(with_programs())
    new = copy(progs)
    s, i = find(new, "optimizer.step")
    step = new[s][i]
    if step.after:
        what = f"optimizer.step without `after {', '.join(step.after)}`"
        step.after = []
    else:  # reductions on the compute stream: the step placed before the last of them
        last = max(j for j, x in enumerate(new[s]) if is_reduction(x.op))
        new[s].insert(last, new[s].pop(i))
        what = f"optimizer.step placed before {new[s][last + 1].op}"
    return _written(case, progs, new, "optimizer-wait", what)


@st.composite
def deadlock(draw):
    case, progs = draw(with_programs())
    s = pick(draw, [s for s, lines in progs.items() if len(lines) >= 2])
    i = draw(st.integers(0, len(progs[s]) - 2))
    j = draw(st.integers(i + 1, len(progs[s]) - 1))
    new = copy(progs)
    new[s][i].after.append(progs[s][j].op)
    return _written(
        case, progs, new, "deadlock", f"{progs[s][i].op} after {progs[s][j].op}, later on '{s}'"
    )


@st.composite
def cycle(draw):
    """A compute op at or before W waits for a comm op that waits for W."""
    case, progs = draw(with_programs())
    pairs = []
    for s, lines in progs.items():
        if s == "compute":
            continue
        for x in lines:
            for w in x.after:
                ws, wi = find(progs, w)
                pairs += [(ws, y, x.op) for y in range(wi + 1)]
    ws, y, x = pick(draw, pairs)
    new = copy(progs)
    new[ws][y].after.append(x)
    return _written(case, progs, new, "cycle", f"{progs[ws][y].op} after {x}")


@st.composite
def missing_op(draw):
    case, progs = draw(with_programs())
    every = [(s, i) for s, lines in progs.items() for i, _ in enumerate(lines)]
    colls = [(s, i) for s, i in every if Op.parse(progs[s][i].op).is_collective]
    s, i = pick(draw, colls if colls and draw(st.integers(0, 3)) else every)
    new = copy(progs)
    gone = new[s].pop(i)
    return _written(case, progs, new, "missing-op", f"{gone.op} left out of '{s}'")


@st.composite
def duplicate_op(draw):
    case, progs = draw(with_programs())
    s = pick(draw, [s for s, lines in progs.items() if lines])
    i = draw(st.integers(0, len(progs[s]) - 1))
    j = draw(st.integers(0, len(progs[s])))
    new = copy(progs)
    new[s].insert(j, Line(progs[s][i].op, []))
    return _written(case, progs, new, "duplicate-op", f"{progs[s][i].op} written twice")


@st.composite
def unexpected_op(draw):
    case, progs = draw(with_programs())
    op = "allgather[b1]@mb0:fwd" if isinstance(case.layout, DDP) else "allreduce[u1]@mb0"
    new = copy(progs)
    s = pick(draw, [s for s in new if s != "compute"] or ["compute"])
    new[s].insert(draw(st.integers(0, len(new[s]))), Line(op, []))
    return _written(case, progs, new, "unexpected-op", f"{op} in a {case.kind} schedule")


@st.composite
def out_of_order(draw):
    """Two neighbouring compute ops swapped, the second needing the first's output."""
    case, progs = draw(with_programs())
    needs = {(str(u), str(v)) for u, v, _ in compile_text(case.text()).graph().needs()}
    lines = progs["compute"]
    swaps = []
    for i in range(len(lines) - 1):
        u, v = lines[i].op, lines[i + 1].op
        if kind(u) in (Kind.FWD, Kind.BWD) and kind(v) in (Kind.FWD, Kind.BWD) and (u, v) in needs:
            new = copy(progs)
            new["compute"][i], new["compute"][i + 1] = new["compute"][i + 1], new["compute"][i]
            if nx.is_directed_acyclic_graph(run_graph(new)):
                swaps.append((i, new))
    i, new = pick(draw, swaps)
    return _written(
        case, progs, new, "out-of-order", f"{lines[i + 1].op} placed before {lines[i].op}"
    )


@st.composite
def missing_event(draw):
    """A wait dropped (not a reduction's, not the optimizer's) that nothing else implies."""
    case, progs = draw(with_programs())
    drops = []
    for s, lines in progs.items():
        for i, x in enumerate(lines):
            if is_reduction(x.op) or x.op == "optimizer.step":
                continue
            for w in x.after:
                new = copy(progs)
                new[s][i].after.remove(w)
                if not nx.has_path(run_graph(new), w, x.op):
                    drops.append((s, i, w, new))
    s, i, w, new = pick(draw, drops)
    return _written(case, progs, new, "missing-event", f"{progs[s][i].op} without `after {w}`")


@st.composite
def recompute_gather(draw):
    """Every layer recomputes; a recompute no longer waits for its unit's backward gather
    (the backward after it waits instead)."""
    case = draw(cases(kinds=("fsdp",), max_k=3))
    case = case.with_(recompute=case.cfg.layers)
    progs = programs_of(case.text())
    moves = []
    for i, x in enumerate(progs["compute"][:-1]):
        nxt = progs["compute"][i + 1]
        if kind(x.op) is Kind.RECOMPUTE and Op.parse(nxt.op) == Op(Kind.BWD, *Op.parse(x.op)[1:3]):
            moves += [(i, w) for w in x.after if kind(w) is Kind.ALLGATHER]
    i, w = pick(draw, moves)
    new = copy(progs)
    new["compute"][i].after.remove(w)
    new["compute"][i + 1].after.append(w)
    x = progs["compute"][i].op
    return _written(case, progs, new, "recompute-gather", f"{x} without `after {w}`")


@st.composite
def recompute_late(draw):
    """A recompute placed after the backward that reads what it rebuilds."""
    case = draw(cases(max_k=3))
    chosen = draw(st.sets(st.sampled_from(case.cfg.layers), min_size=1))
    case = case.with_(recompute=tuple(x for x in case.cfg.layers if x in chosen))
    progs = programs_of(case.text())
    lines = progs["compute"]
    spots = [i for i, x in enumerate(lines[:-1]) if kind(x.op) is Kind.RECOMPUTE]
    i = pick(draw, spots)
    new = copy(progs)
    a, b = new["compute"][i], new["compute"][i + 1]
    # the waits stay with the first of the two, so only the order changes
    a.after, b.after = b.after, a.after
    new["compute"][i], new["compute"][i + 1] = b, a
    return _written(case, progs, new, "recompute-late", f"{a.op} placed after {b.op}")


@st.composite
def recompute_freed(draw):
    """A recompute written for a layer that does not recompute (its input was freed)."""
    case = draw(cases(max_k=3))
    progs = programs_of(case.text())
    lines = progs["compute"]
    plain = [
        i
        for i, x in enumerate(lines)
        if kind(x.op) is Kind.BWD and Op.parse(x.op).target not in case.recompute
    ]
    i = pick(draw, plain)
    op = Op.parse(lines[i].op)
    again = str(Op(Kind.RECOMPUTE, op.target, op.mb))
    new = copy(progs)
    new["compute"].insert(i, Line(again, []))
    return _written(case, progs, new, "recompute-freed", f"{again} before {op}")


MUTATIONS = {  # name: (strategy, examples under the ci profile)
    "uncovered": (uncovered(), 48),
    "double-cover": (double_cover(), 36),
    "unknown-layer": (unknown_layer(), 36),
    "tied-param": (tied_param(), 36),
    "unit-contiguous": (unit_contiguous(), 24),
    "batch-arithmetic": (batch_arithmetic(), 36),
    "context-length": (context_length(), 24),
    "value-range": (value_range(), 24),
    "unknown-setting": (unknown_setting(), 15),
    "missing-setting": (missing_setting(), 18),
    "duplicate": (duplicate(), 15),
    "conflict": (conflict(), 18),
    "compute-stream": (compute_stream(), 15),
    "memory-budget": (memory_budget(), 36),
    "spmd": (spmd(), 45),
    "early-reduce": (early_reduce(), 45),
    "use-after-free": (use_after_free(), 36),
    "nosync-comm": (nosync_comm(), 30),
    "optimizer-wait": (optimizer_wait(), 30),
    "deadlock": (deadlock(), 30),
    "cycle": (cycle(), 30),
    "missing-op": (missing_op(), 30),
    "duplicate-op": (duplicate_op(), 18),
    "unexpected-op": (unexpected_op(), 18),
    "out-of-order": (out_of_order(), 30),
    "missing-event": (missing_event(), 30),
    "recompute-gather": (recompute_gather(), 15),
    "recompute-late": (recompute_late(), 15),
    "recompute-freed": (recompute_freed(), 15),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_broken_rule_is_rejected_with_its_code(name):
    strategy, n = MUTATIONS[name]

    @settings(max_examples=examples(n))
    @given(m=strategy)
    def prop(m: Mutant):
        note(f"mutation: {m.what}\n--- broken schedule ---\n{m.text}")
        compile_text(m.control, "control.sched")  # the unbroken schedule is legal
        with pytest.raises(CompileError) as e:
            compile_text(m.text, "mutant.sched")
        assert m.code in e.value.codes, f"expected [{m.code}], got:\n{e.value.render()}"
        tally("mutation", m.code)
        rejected.append(m.code)

    rejected: list[str] = []
    prop()
    # enough cases of its own (not a share of a session-wide count, which would depend on
    # which xdist worker ran which test): hypothesis's filters and dedup may drop some
    assert len(rejected) >= floor(n), (name, len(rejected), examples(n))


def floor(n: int) -> int:
    """Cases a mutation must produce of its `n` examples: half (10x under long)."""
    return max(1, examples(n) // 2)


# every mutation at its floor still makes 200 cases (10x under long)
assert sum(floor(n) for _, n in MUTATIONS.values()) >= examples(200)


# -- rules across ranks (found by this suite, enforced since) -----------------------------------

# Collectives on two streams (here gathers on `comm`, reduce-scatters on `rs`), and ranks
# that wait for them in opposite orders: rank 0's `rs` waits for u1's backward gather
# before reduce-scattering u2, rank 1's `comm` waits for that reduce-scatter before the
# gather. Each rank's graph is acyclic and each stream's collective order is the same
# on every rank, so a per-rank check accepted it, and run, it hung (rank 0 waits for a
# gather rank 1 never issues, rank 1 for a reduce-scatter rank 0 never issues). The cycle
# only exists across ranks: a collective completes on all ranks at once, so the checker
# now proves the ranks' graphs acyclic together ([spmd]).
CROSS_RANK_DEADLOCK = """\
model nano { n_layer = 1 }
world 2
batch 2 x 16
micro 1
fsdp {
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0
  unit u2 = head
}
stream reducescatter = rs
program rs on rank 0 {
  reducescatter[u2]@mb0 after bwd[head]@mb0, allgather[u1]@mb0:bwd
  reducescatter[tied]@mb0 after bwd[embed]@mb0
  reducescatter[u1]@mb0
}
program comm on rank 1 {
  allgather[tied]@mb0:fwd
  allgather[u1]@mb0:fwd
  allgather[u2]@mb0:fwd
  allgather[u2]@mb0:bwd after free[u2]@mb0:fwd
  allgather[u1]@mb0:bwd after reducescatter[u2]@mb0
}
"""


def test_ranks_waiting_across_collective_streams_in_opposite_orders_are_rejected():
    with pytest.raises(CompileError) as e:
        compile_text(CROSS_RANK_DEADLOCK, "deadlock.sched")
    assert {"spmd", "cycle", "deadlock"} & set(e.value.codes), e.value.render()


@st.composite
def cross_rank_cycle(draw):
    """The same shape, generated: a gather G and a reduce-scatter R on different streams,
    neither ordered before the other; rank 0 makes R wait for G, rank 1 G for R."""
    case = draw(cases(kinds=("fsdp",), worlds=(2, 3, 4), max_k=3))
    case = case.with_(layout=replace(case.layout, streams=(("reducescatter", "rs"),)))
    progs = programs_of(case.text())
    g = run_graph(progs)
    pairs = [
        (x.op, y.op)
        for x in progs["comm"]
        for y in progs["rs"]
        if not nx.has_path(g, x.op, y.op) and not nx.has_path(g, y.op, x.op)
    ]
    gather, rs = pick(draw, pairs)
    mine, theirs = copy(progs), copy(progs)
    mine["rs"][[x.op for x in mine["rs"]].index(rs)].after.append(gather)
    theirs["comm"][[x.op for x in theirs["comm"]].index(gather)].after.append(rs)
    text = case.with_(
        extra=program_lines({"rs": mine["rs"]}, 0) + program_lines({"comm": theirs["comm"]}, 1)
    ).text()
    return Mutant(
        "spmd", text, f"rank 0: {rs} after {gather}; rank 1: {gather} after {rs}", case.text()
    )


def test_generated_cross_rank_wait_cycles_are_rejected():
    @settings(max_examples=examples(10), phases=[Phase.generate])
    @given(m=cross_rank_cycle())
    def prop(m: Mutant):
        note(f"mutation: {m.what}\n{m.text}")
        with pytest.raises(CompileError) as e:
            compile_text(m.text, "mutant.sched")
        assert {"spmd", "cycle", "deadlock"} & set(e.value.codes), e.value.render()

    prop()


# The memory budget holds on every rank's plan (it was once checked against the plan of
# the ranks without programs of their own only). Here rank 1 frees u2 three ops later
# than the others, so its predicted peak is 761,216 B, over the budget of 710,400 B (the
# common plan's peak, which fits exactly).
RANK_OVER_BUDGET = """\
model nano { n_layer = 2 }
world 2
batch 2 x 16
micro 1
fsdp {
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0
  unit u2 = h.1
  unit u3 = head
  prefetch forward 1
  prefetch backward 1
}
memory 710400 B
program compute on rank 1 {
  fwd[embed]@mb0 after allgather[u1]@mb0:fwd
  fwd[h.0]@mb0
  free[u1]@mb0:fwd
  fwd[h.1]@mb0 after allgather[u2]@mb0:fwd
  free[u2]@mb0:fwd
  fwd[head]@mb0 after allgather[u3]@mb0:fwd
  free[u3]@mb0:fwd
  bwd[head]@mb0 after allgather[u3]@mb0:bwd
  free[u3]@mb0:bwd
  bwd[h.1]@mb0 after allgather[u2]@mb0:bwd
  bwd[h.0]@mb0 after allgather[u1]@mb0:bwd
  bwd[embed]@mb0
  free[u1]@mb0:bwd
  free[u2]@mb0:bwd
  free[tied]@mb0:bwd
  optimizer.step after reducescatter[u1]@mb0
}
"""


def test_the_memory_budget_example_is_what_it_says():
    """The case below, measured: the common plan fits exactly, rank 1's does not."""
    from schedc.passes.memory import predict

    c = compile_text(RANK_OVER_BUDGET.replace("memory 710400 B\n", ""))
    assert predict(c.spec, c.plan()).peak == 710400
    assert predict(c.spec, c.plan(1)).peak > 710400


def test_a_rank_whose_own_program_exceeds_the_memory_budget_is_rejected():
    with pytest.raises(CompileError) as e:
        compile_text(RANK_OVER_BUDGET, "rank1.sched")
    assert "memory-budget" in e.value.codes


# -- written programs round-trip ------------------------------------------------------------------


@settings(max_examples=examples(100))
@given(case=cases(max_k=4))
def test_written_out_programs_compile_back_to_the_same_plan(case):
    """`--dump program` pasted into the schedule proves the same plan (the mutations'
    starting point, and the README's promise)."""
    base = compile_text(case.text())
    text = case.with_(extra=program_lines(programs_of(case.text()))).text()
    note(text)
    assert compile_text(text).plan() == base.plan()
    tally("roundtrip", case.kind)


# -- parser fuzz: edits of generated schedules ------------------------------------------------

VOCAB = [
    "model",
    "world",
    "batch",
    "micro",
    "accumulate",
    "steps",
    "seed",
    "memory",
    "data",
    "optimizer",
    "ddp",
    "fsdp",
    "stream",
    "program",
    "bucket",
    "bucket_cap",
    "first",
    "overlap",
    "no_sync",
    "unit",
    "keep",
    "prefetch",
    "forward",
    "backward",
    "reshard_after_forward",
    "on",
    "off",
    "after",
    "rank",
    "text",
    "tokens",
    "x",
    "{",
    "}",
    "=",
    ",",
    "..",
    "#",
    '"',
    "KiB",
    "MiB",
    "B",
    "embed",
    "head",
    "h.0",
    "h.9",
    TIED,
    "0",
    "-1",
    "1e9",
    "3.5",
    "1" * 30,
    "fwd[h.0]@mb0",
    "allreduce[b1]@mb9",
    "allgather[u1]@mb0:fwd",
    "optimizer.step",
    "bwd[]@mb",
    "free[x]@mb0:side",
    "\t",
    "\n",
    "\u00e9",
    "\x00",
    "\ufeff",
    "\r",
]


@st.composite
def edited_schedules(draw):
    case = draw(cases(max_k=3))
    text = case.text()
    if draw(st.booleans()):
        text = case.with_(extra=program_lines(programs_of(text))).text()
    for _ in range(draw(st.integers(1, 3))):
        n = len(text)
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, min(n, a + 40)))
        how = draw(
            st.sampled_from(["delete", "duplicate", "insert", "replace", "swap-lines", "truncate"])
        )
        if how == "delete":
            text = text[:a] + text[b:]
        elif how == "duplicate":
            text = text[:b] + text[a:b] + text[b:]
        elif how == "insert":
            tok = draw(st.sampled_from(VOCAB))
            sep = draw(st.sampled_from(["", " "]))
            text = text[:a] + sep + tok + sep + text[a:]
        elif how == "replace":
            text = text[:a] + draw(st.characters(codec="utf-8")) + text[a + 1 :]
        elif how == "swap-lines":
            lines = text.split("\n")
            i, j = (draw(st.integers(0, len(lines) - 1)) for _ in range(2))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        else:
            text = text[:a]
    return text


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError if the block runs longer (a hang is a failure, not a stall)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


FUZZ_LIMIT_S = 30.0  # a hang guard, not a speed target


@settings(max_examples=examples(400))
@given(text=edited_schedules())
def test_edited_schedules_give_diagnostics_never_a_traceback(text):
    note(repr(text))
    t0 = time.perf_counter()
    with time_limit(FUZZ_LIMIT_S):
        try:
            compile_text(text, "fuzz.sched")
            outcome = "compiled"
        except CompileError as e:
            outcome = "rejected"
            assert e.diagnostics and all(d.code in CODES for d in e.diagnostics)
            rendered = e.render()
            assert "Traceback" not in rendered
            for d in e.diagnostics:
                assert f"[{d.code}]" in rendered
                if d.span is not None:
                    assert 0 <= d.span.start <= d.span.end <= len(text), d
    tally("fuzz", outcome)
    assert time.perf_counter() - t0 < FUZZ_LIMIT_S

"""Hypothesis strategies for valid .sched schedules, and a tally of the cases a session ran.

Every strategy draws a small structured value, a `Case`, and `Case.text()` renders it, so a
failing example shrinks to a schedule a person can read at a glance:

    model nano { n_layer = 1 }
    world 2
    batch 4 x 16
    micro 1
    seed 7
    optimizer adamw { lr = 1e-3  warmup = 1  clip = 1 }
    ddp {
      bucket b1 = head .. embed
      overlap off
      no_sync off
    }

What they span (issue #6):
* world 1-4; micro 1-2 sequences x k = 1-8 micro-steps, the file stating `micro`,
  `accumulate` or both; the `nano` model with 1-3 blocks; 16 or 32 tokens; 1-2 steps.
* DDP: buckets that group the layers contiguously in gradient-ready order (head first),
  some layers split into their parameters (`wte.weight` can be a bucket of its own), now
  and then the tied weight listed first (legal; it warns), or byte caps
  `bucket_cap N KiB [first M KiB]`; overlap and no_sync on or off.
* a precision policy (issue #13): fp32, bf16 compute, bf16 gather (FSDP), or bf16 reduce
  (with bf16 compute, and for FSDP bf16 gathers too).
* FSDP: contiguous groups of layers as units, the tied `wte.weight` in a keep unit of its
  own, in a keep root with embed and head, or everything in one unit; now and then
  another unit kept gathered; prefetch 0-3 each way; reshard_after_forward and no_sync;
  now and then gathers or reduce-scatters on another stream (`stream reducescatter = rs`,
  `stream allgather = compute`).
* recompute (issue #16): in one case of four, some layers recompute (`recompute h.0, head`),
  or every one of them; the executor's step must not change.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cache

import networkx as nx
import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st

from schedc.compiler import compile_text
from schedc.model.arch import SIZES, GPTConfig

TIED = "wte.weight"
OPTIMIZER = "optimizer adamw {{ lr = 1e-3  warmup = 1  clip = {clip} }}"
# the precision axis: policy -> its line, per strategy (None: the default, fp32)
PRECISIONS = {
    "fp32": {"ddp": None, "fsdp": None},
    "bf16-compute": {"ddp": "precision { compute = bf16 }", "fsdp": "precision { compute = bf16 }"},
    "bf16-gather": {"fsdp": "precision bf16"},  # compute and gathers bf16, reduce fp32
    "bf16-reduce": {
        "ddp": "precision { compute = bf16  reduce = bf16 }",
        "fsdp": "precision bf16 { reduce = bf16 }",
    },
}


@cache
def model(n_layer: int) -> GPTConfig:
    return SIZES["nano"].with_overrides(n_layer=n_layer)


# -- the structured values --------------------------------------------------------------------


@dataclass(frozen=True)
class DDP:
    buckets: tuple[tuple[str, ...], ...] = ()  # layers or parameters per bucket, launch order
    cap: tuple[int, int | None] | None = None  # bucket_cap KiB [first KiB], instead of buckets
    overlap: bool = True
    no_sync: bool = True
    kind = "ddp"

    def block(self, cfg: GPTConfig) -> list[str]:
        if self.cap is not None:
            size, first = self.cap
            body = [f"bucket_cap {size} KiB" + (f" first {first} KiB" if first else "")]
        else:
            body = [f"bucket b{i + 1} = {refs(b, cfg)}" for i, b in enumerate(self.buckets)]
        body += [f"overlap {_on(self.overlap)}", f"no_sync {_on(self.no_sync)}"]
        return ["ddp {", *(f"  {x}" for x in body), "}"]


@dataclass(frozen=True)
class Unit:
    name: str
    items: tuple[str, ...]  # layers or parameters, forward order
    keep: bool = False


@dataclass(frozen=True)
class FSDP:
    units: tuple[Unit, ...]
    prefetch: tuple[int, int] = (1, 1)  # forward, backward
    reshard: bool = True
    no_sync: bool = False
    streams: tuple[tuple[str, str], ...] = ()  # `stream KIND = NAME` lines: (kind, stream)
    kind = "fsdp"

    def block(self, cfg: GPTConfig) -> list[str]:
        body = [
            f"unit {u.name} = {refs(u.items, cfg)}" + (" keep" if u.keep else "")
            for u in self.units
        ]
        body += [
            f"prefetch forward {self.prefetch[0]}",
            f"prefetch backward {self.prefetch[1]}",
            f"reshard_after_forward {_on(self.reshard)}",
            f"no_sync {_on(self.no_sync)}",
        ]
        return [
            "fsdp {",
            *(f"  {x}" for x in body),
            "}",
            *(f"stream {k} = {s}" for k, s in self.streams),
        ]


@dataclass(frozen=True)
class Case:
    """One valid schedule: global batch = micro x k x world sequences of seq_len tokens."""

    layout: DDP | FSDP
    n_layer: int = 2
    world: int = 1
    micro: int = 1
    k: int = 1
    seq_len: int = 16
    steps: int = 1
    stated: str = "micro"  # which of micro / accumulate the file states: micro|accumulate|both
    clip: float = 1.0
    precision: str = "fp32"  # a PRECISIONS key
    recompute: tuple[str, ...] = ()  # layers that recompute, forward order
    extra: tuple[str, ...] = field(default=(), compare=False)  # lines appended (mutations)
    mesh: tuple[int, int] | None = None  # replicate x shard (HSDP); None: flat

    @property
    def seqs(self) -> int:
        return self.micro * self.k * self.world

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def cfg(self) -> GPTConfig:
        return model(self.n_layer)

    def lines(self) -> list[str]:
        m = "model nano" if self.n_layer == 2 else f"model nano {{ n_layer = {self.n_layer} }}"
        out = [m, f"world {self.world}", f"batch {self.seqs} x {self.seq_len}"]
        if self.mesh:
            out.insert(2, f"mesh {self.mesh[0]} x {self.mesh[1]}")
        if self.stated in ("micro", "both"):
            out.append(f"micro {self.micro}")
        if self.stated in ("accumulate", "both"):
            out.append(f"accumulate {self.k}")
        out += ["seed 7", OPTIMIZER.format(clip=_num(self.clip))]
        if line := PRECISIONS[self.precision][self.kind]:
            out.append(line)
        if self.recompute:
            out.append(f"recompute {refs(self.recompute, self.cfg)}")
        return out + self.layout.block(self.cfg) + list(self.extra)

    def text(self) -> str:
        return "\n".join(self.lines()) + "\n"

    def with_(self, **changes) -> Case:
        return replace(self, **changes)


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else str(x)


def refs(items, cfg: GPTConfig) -> str:
    """`head, h.1 .. h.0, wpe.weight`: runs of three or more adjacent layers as ranges."""
    index = {layer: i for i, layer in enumerate(cfg.layers)}
    parts: list[str] = []
    run: list[str] = []

    def flush() -> None:
        parts.extend([f"{run[0]} .. {run[-1]}"] if len(run) >= 3 else run)
        run.clear()

    for it in items:
        if (
            it in index
            and run
            and abs(index[it] - index[run[-1]]) == 1
            and (len(run) < 2 or index[it] - index[run[-1]] == index[run[-1]] - index[run[-2]])
        ):
            run.append(it)
            continue
        flush()
        (run if it in index else parts).append(it)
    flush()
    return ", ".join(parts)


def ready_items(cfg: GPTConfig, split=frozenset()) -> list[str]:
    """Layers (the `split` ones as their parameters) in the order their gradients complete:
    backward visits head first; within a layer, reverse registration order; wte.weight,
    written by bwd[head] and last by bwd[embed], completes at the very end."""
    out: list[str] = []
    for layer in reversed(cfg.layers):
        if layer in split:
            out += [p.name for p in reversed(cfg.layer_params(layer))]
        else:
            out.append(layer)
    return out


def _partition(draw, items: list[str], max_cuts: int = 4) -> list[tuple[str, ...]]:
    """Contiguous groups of `items`; shrinks towards one group."""
    if len(items) < 2:
        return [tuple(items)]
    cuts = sorted(draw(st.sets(st.integers(1, len(items) - 1), max_size=max_cuts)))
    return [tuple(items[a:b]) for a, b in zip([0, *cuts], [*cuts, len(items)])]


# -- strategies -------------------------------------------------------------------------------


@st.composite
def ddp_layouts(draw, cfg: GPTConfig, explicit: bool | None = None):
    """Buckets (contiguous in gradient-ready order) or a byte cap; overlap, no_sync."""
    overlap, no_sync = draw(st.booleans()), draw(st.booleans())
    use_cap = (not explicit) if explicit is not None else draw(st.integers(0, 3)) == 3
    if use_cap:
        cap = (draw(st.integers(1, 96)), draw(st.none() | st.integers(1, 48)))
        return DDP(cap=cap, overlap=overlap, no_sync=no_sync)
    split = draw(st.sets(st.sampled_from(cfg.layers), max_size=2))
    groups = [list(g) for g in _partition(draw, ready_items(cfg, frozenset(split)))]
    if len(groups) > 1 and draw(st.integers(0, 4)) == 4:
        # the tied weight in the first bucket: legal, but that bucket completes last
        groups = [[x for x in g if x != TIED] for g in groups]
        groups = [["wpe.weight" if x == "embed" else x for x in g] for g in groups]
        groups[0].append(TIED)
        groups = [g for g in groups if g]
    return DDP(tuple(tuple(g) for g in groups), overlap=overlap, no_sync=no_sync)


@st.composite
def fsdp_layouts(draw, cfg: GPTConfig):
    """Units: contiguous groups of layers, with the tied weight where both users see it."""
    blocks = [x for x in cfg.layers if x.startswith("h.")]
    tied = draw(st.sampled_from(["one", "own", "root"]))
    if tied == "one":
        fixed, groups = [], [tuple(cfg.layers)]
    elif tied == "own":
        fixed = [Unit("tied", (TIED,), keep=True)]
        groups = _partition(draw, ["wpe.weight", *blocks, "head"])
    else:
        fixed = [Unit("root", ("embed", "head"), keep=True)]
        groups = _partition(draw, blocks)
    kept = set()
    if draw(st.integers(0, 4)) == 4:  # now and then a unit of blocks stays gathered too
        kept = {draw(st.integers(0, len(groups) - 1))}
    names = ["all"] if tied == "one" else [f"u{i + 1}" for i in range(len(groups))]
    units = fixed + [Unit(n, g, i in kept) for i, (n, g) in enumerate(zip(names, groups))]
    prefetch = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    streams = (
        draw(
            st.sampled_from(
                [
                    (),  # gathers and reduce-scatters share the comm stream
                    (("reducescatter", "rs"),),  # reduce-scatters on a comm stream of their own
                    (("allgather", "compute"),),  # no overlap for gathers
                    (("allgather", "compute"), ("reducescatter", "compute")),  # nothing overlaps
                ]
            )
        )
        if draw(st.integers(0, 3)) == 3
        else ()
    )
    return FSDP(
        tuple(units),
        prefetch,
        reshard=not draw(st.booleans()),
        no_sync=draw(st.booleans()),
        streams=streams,
    )


@st.composite
def cases(
    draw,
    kinds=("ddp", "fsdp"),
    worlds=(1, 2, 3, 4),
    max_k: int = 8,
    explicit: bool | None = None,
    no_sync: bool | None = None,
    min_k: int = 1,
    precisions=("fp32",),
):
    """A valid schedule. `explicit`: DDP buckets written out (True) or a byte cap (False);
    `no_sync`: force the strategy's no_sync; `precisions`: the policies drawn from (those
    the strategy has; the first shrinks best)."""
    n_layer = draw(st.integers(1, 3))
    cfg = model(n_layer)
    world = draw(st.sampled_from(worlds))
    micro = draw(st.integers(1, 2))
    k = draw(st.integers(min_k, max_k))
    seq_len = draw(st.sampled_from([16, 32]))
    kind = draw(st.sampled_from(kinds))
    layout = draw(ddp_layouts(cfg, explicit) if kind == "ddp" else fsdp_layouts(cfg))
    if no_sync is not None:
        layout = replace(layout, no_sync=no_sync)
    precision = draw(st.sampled_from([p for p in precisions if kind in PRECISIONS[p]]))
    return Case(
        layout,
        n_layer,
        world,
        micro,
        k,
        seq_len,
        steps=draw(st.integers(1, 2)),
        stated=draw(st.sampled_from(["micro", "accumulate", "both"])),
        clip=draw(st.sampled_from([1.0, 0.0])),
        precision=precision,
        recompute=draw(recomputes(cfg)),  # drawn last: the axes before it draw as they did
    )


@st.composite
def recomputes(draw, cfg: GPTConfig) -> tuple[str, ...]:
    """The recompute axis: in one case of four some layers recompute, or all of them."""
    if draw(st.integers(0, 3)) != 3:
        return ()
    chosen = draw(st.sets(st.sampled_from(cfg.layers), min_size=1))
    return tuple(x for x in cfg.layers if x in chosen)


@st.composite
def hsdp_cases(draw, meshes=((2, 2), (2, 3), (3, 2)), max_k: int = 3):
    """A valid FSDP schedule on a 2-D mesh (replicate x shard), its world the mesh's."""
    mesh = draw(st.sampled_from(meshes))
    case = draw(cases(kinds=("fsdp",), worlds=(mesh[0] * mesh[1],), max_k=max_k))
    return case.with_(mesh=mesh)


@st.composite
def agreeing_pairs(draw):
    """Two schedules of one model, global batch and optimizer, laid out differently (world,
    micro-batch, strategy): `schedc check a b` says they agree."""
    n_layer = draw(st.integers(1, 3))
    cfg = model(n_layer)
    seqs = draw(st.sampled_from([2, 4, 6, 8, 12, 16]))
    shared = {
        "n_layer": n_layer,
        "seq_len": draw(st.sampled_from([16, 32])),
        "steps": draw(st.integers(1, 2)),
        "clip": draw(st.sampled_from([1.0, 0.0])),
    }

    def side() -> Case:
        world = draw(st.sampled_from([d for d in (1, 2, 3, 4) if seqs % d == 0]))
        per_rank = seqs // world
        micro = draw(
            st.sampled_from([m for m in (1, 2, 3, 4) if per_rank % m == 0 and per_rank // m <= 8])
        )
        kind = draw(st.sampled_from(["ddp", "fsdp"]))
        layout = draw(ddp_layouts(cfg) if kind == "ddp" else fsdp_layouts(cfg))
        return Case(
            layout,
            world=world,
            micro=micro,
            k=per_rank // micro,
            stated=draw(st.sampled_from(["micro", "accumulate", "both"])),
            **shared,
        )

    a, b = side(), side()
    assume((a.world, a.micro, a.layout) != (b.world, b.micro, b.layout))
    return a, b


# -- written programs: the text --dump program prints, as data ---------------------------------


@dataclass
class Line:
    op: str
    after: list[str]


Programs = dict[str, list[Line]]  # stream -> its ops in program order


def programs_of(text: str) -> Programs:
    """The generated programs of a valid schedule, parsed from what `schedc check --dump
    program` prints (schedc.passes.dump.dump_program)."""
    progs: Programs = {}
    stream = None
    for raw in compile_text(text).dump("program").splitlines():
        raw = raw.strip()
        if raw.startswith("program "):
            stream = raw.split()[1]
            progs[stream] = []
        elif raw != "}":
            op, _, after = raw.partition(" after ")
            progs[stream].append(Line(op, [a.strip() for a in after.split(",")] if after else []))
    return progs


def program_lines(progs: Programs, rank: int | None = None) -> tuple[str, ...]:
    on = f" on rank {rank}" if rank is not None else ""
    out = []
    for stream, lines in progs.items():
        out.append(f"program {stream}{on} {{")
        out += [f"  {x.op}" + (f" after {', '.join(x.after)}" if x.after else "") for x in lines]
        out.append("}")
    return tuple(out)


def copy(progs: Programs) -> Programs:
    return {s: [Line(x.op, list(x.after)) for x in lines] for s, lines in progs.items()}


def run_graph(progs: Programs):
    """What runs: each stream in its order, each `after` a wait (a networkx DiGraph; an
    oracle independent of the checker)."""
    g = nx.DiGraph()
    for lines in progs.values():
        g.add_nodes_from(x.op for x in lines)
        g.add_edges_from((a.op, b.op) for a, b in itertools.pairwise(lines))
        g.add_edges_from((w, x.op) for x in lines for w in x.after)
    return g


# -- how many examples, and a tally of the cases that ran ----------------------------------------


def examples(n: int) -> int:
    """n under the `ci` profile (max_examples 100), 10 n under `long` (1000): scaled by the
    loaded profile, so each test keeps its share of the budget."""
    return max(1, n * settings.default.max_examples // 100)


TALLY: Counter = Counter()  # (family, *key) -> cases that passed, this session


def tally(*key) -> None:
    TALLY[key] += 1


def summary() -> list[str]:
    """Lines for the end of the session: equivalence cases by (strategy, world), mutation
    cases by code."""
    if not TALLY:
        return []
    profile = getattr(settings, "_current_profile", "?")
    lines = []
    eq = {k[1:]: n for k, n in TALLY.items() if k[0] == "equivalence"}
    if eq:
        by = ", ".join(f"{kind} w{w}: {n}" for (kind, w), n in sorted(eq.items()))
        lines.append(f"equivalence cases (fp32, vs the reference): {sum(eq.values())} [{by}]")
    families = ("precision", "recompute", "float64", "pairs", "rewritten", "roundtrip", "fuzz")
    for family in (*families, "pipeline", "operand perturbations"):
        sub = {k[1:]: n for k, n in TALLY.items() if k[0] == family}
        if sub:
            by = ", ".join(
                f"{'/'.join(map(str, key)) or '-'}: {n}" for key, n in sorted(sub.items())
            )
            lines.append(f"{family} cases: {sum(sub.values())} [{by}]")
    mut = {k[1]: n for k, n in TALLY.items() if k[0] == "mutation"}
    if mut:
        by = ", ".join(f"{code}: {n}" for code, n in sorted(mut.items()))
        lines.append(
            f"mutation cases (rejected with their rule's code): {sum(mut.values())} [{by}]"
        )
    proof = {k[1]: n for k, n in TALLY.items() if k[0] == "proof"}
    if proof:
        by = ", ".join(f"{cls}: {n}" for cls, n in sorted(proof.items()))
        lines.append(f"plan mutations (refuted by the proof): {sum(proof.values())} [{by}]")
    return [f"schedc property suite, hypothesis profile '{profile}':", *lines]


class SummaryPlugin:
    """Prints `summary()` in pytest's terminal summary (registered by tests/conftest.py).
    Under pytest-xdist each worker tallies its own cases and hands them to the controller
    when it finishes, which prints their sum."""

    def pytest_sessionfinish(self, session):
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller prints the summary
            workeroutput["schedc_tally"] = [[list(k), n] for k, n in TALLY.items()]

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        for key, n in getattr(node, "workeroutput", {}).get("schedc_tally", []):
            TALLY[tuple(key)] += n

    def pytest_terminal_summary(self, terminalreporter):
        lines = summary()
        if lines:
            terminalreporter.section("schedc generated cases")
            for line in lines:
                terminalreporter.write_line(line)

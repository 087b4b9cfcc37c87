"""The space `schedc tune` searches: what a schedule file fixes, and the knobs it leaves open.

    Base.read(path)          the file split into what tune keeps (model, world, batch, data,
                             optimizer, steps, seed, numerics it does not search) and drops
                             (micro/accumulate, memory, ddp/fsdp blocks, the mesh, streams,
                             programs: tune searches flat layouts only, not HSDP)
    candidates(base, ...)    every Knobs the search considers, in a fixed order
    base.text(knobs)         a whole schedule: the file with the dropped statements blanked
                             out (so a diagnostic about a kept line points at the user's
                             line and column) and the knobs written after it

Candidates are ordinary schedule text; the compiler (schedc/compiler.py) judges each one,
so nothing here decides legality.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.ir.source import Source, Span
from schedc.ir.spec import Dtype, MiB, Numerics, Strategy
from schedc.lang.parse import parse
from schedc.lang.read import read_source
from schedc.lang.syntax import (
    DDP,
    FSDP,
    Memory,
    MeshDecl,
    Pipeline,
    Precision,
    Program,
    Setting,
    StreamDecl,
    to_ast,
)
from schedc.model.arch import GPTConfig

SEARCHED_SETTINGS = ("micro", "accumulate")
BUCKET_CAPS = (1 * MiB, 4 * MiB, 25 * MiB, 100 * MiB)  # DDP's default is 25 MiB
PREFETCH = (0, 1, 2)  # depth, forward and backward alike
MAX_COMPOSITIONS = 16  # all contiguous partitions up to 5 blocks; balanced ones past that


@dataclass(frozen=True)
class Knobs:
    """One point of the space: everything a candidate chooses. Fields of the other strategy
    keep their defaults, so equal Knobs are equal schedules."""

    strategy: str  # "single" | "ddp" | "fsdp"
    micro: int
    precision: str | None = None  # a policy searched (--precision); None: the file's numerics
    # the file's numerics written out for this strategy, where its `precision` statement
    # would mean other arithmetic here (`precision bf16` gathers in bf16 under FSDP, and a
    # DDP file's bf16 step gathers nothing): None, the statement is kept as written
    policy: Numerics | None = None
    # ddp
    layout: str = ""  # "cap" | "per-layer" | "one"
    cap: int = 0  # bytes, with layout "cap"
    # fsdp: block groups as (first, last) block indexes; wpe joins the first, head the last
    groups: tuple[tuple[int, int], ...] = ()
    prefetch: int = 0
    reshard: bool = True
    keep_all: bool = False  # every unit gathered once per step (kept), not only the tied one
    no_sync: bool = False

    def describe(self) -> str:
        """The knobs in a table's width: `ddp cap 25MiB sync` / `fsdp 3u pf1 rs ks`."""
        prec = f" {self.precision}" if self.precision else ""
        ns = " no_sync" if self.no_sync else ""
        if self.strategy == "ddp":
            lay = f"cap {self.cap // MiB}MiB" if self.layout == "cap" else self.layout
            return f"ddp {lay}{ns}{prec}"
        if self.strategy == "fsdp":
            sizes = "+".join(str(b - a + 1) for a, b in self.groups)
            extra = (" keep-all" if self.keep_all else "") + ("" if self.reshard else " no-reshard")
            return f"fsdp [{sizes}] pf{self.prefetch}{extra}{ns}{prec}"
        return f"single{prec}"


def comments_above(text: str, start: int) -> int:
    """Where a statement starting at `start` begins with the comment lines right above it
    (no blank line between): a comment there describes it, and goes where it goes. A
    statement that does not begin its line, or whose comments are the file's first lines
    (its header), keeps the lines above."""
    first = line = text.rfind("\n", 0, start) + 1
    if text[line:start].strip():
        return start
    while line > 0:
        above = text.rfind("\n", 0, line - 1) + 1
        if not text[above : line - 1].strip().startswith("#"):
            return line
        line = above
    return first


@dataclass(frozen=True)
class Base:
    """A schedule file as tune sees it: the statements it keeps, where the dropped ones were."""

    source: Source
    dropped: tuple[Span, ...]
    memory: str | None  # the file's `memory` size as written, the default budget
    precision: Span | None  # the file's `precision` statement: dropped when tune searches it
    world: int = 1  # as written (the compiler judges it)
    mesh: str | None = None  # the file's `mesh` statement as written: HSDP, not searched
    pipeline: Span | None = None  # a `pipeline` block: tune/pipeline.py writes it anew
    memory_span: Span | None = None
    kind: Strategy = Strategy.SINGLE  # the file's own strategy (its numerics mean it)

    @classmethod
    def read(cls, path: str | Path) -> Base:
        source = read_source(path)
        ast = to_ast(parse(source), source)  # a syntax error is the user's, located
        dropped, memory, precision, world, mesh = [], None, None, 1, None
        pipeline, memory_span, kind = None, None, Strategy.SINGLE
        for s in ast.stmts:
            if isinstance(s, Setting) and s.key in SEARCHED_SETTINGS:
                dropped.append(s.span)
            elif isinstance(s, Memory):
                memory, memory_span = source.snippet(s.size.span), s.span
                dropped.append(s.span)
            elif isinstance(s, DDP | FSDP | StreamDecl | Program | MeshDecl):
                # a `mesh` goes with the strategy: tune searches flat DDP and FSDP layouts
                # (HSDP is not in its space yet), and a DDP candidate takes no shard mesh
                dropped.append(s.span)
                mesh = source.snippet(s.span) if isinstance(s, MeshDecl) else mesh
                kind = {DDP: Strategy.DDP, FSDP: Strategy.FSDP}.get(type(s), kind)
            elif isinstance(s, Precision):
                precision = s.span
            pipeline = s.span if isinstance(s, Pipeline) else pipeline
            if isinstance(s, Setting) and s.key == "world" and s.value.is_int:
                world = int(s.value.text)
        return cls(
            source, tuple(dropped), memory, precision, world, mesh, pipeline, memory_span, kind
        )

    def kept_text(
        self, *, blank: bool, precision: bool = True, extra: tuple[Span, ...] = ()
    ) -> str:
        """The file without the dropped statements (and their trailing comments): blanked
        with spaces, newlines kept, so positions hold (`blank`); or cut, for a file to read.
        `precision`: keep the file's precision statement; `extra`: more statements to drop."""
        drop = (
            self.dropped + extra + ((self.precision,) if self.precision and not precision else ())
        )
        kept = _blanked(self.source.text, drop, blank)
        if blank:
            return kept
        lines = [ln.rstrip() for ln in kept.split("\n")]
        tidy: list[str] = []
        for ln in lines:  # no runs of blank lines where statements were cut
            if ln or (tidy and tidy[-1]):
                tidy.append(ln)
        return "\n".join(tidy).rstrip("\n") + "\n"

    def unbudgeted_text(self) -> str:
        """The file as written but for its `memory` (blanked): what the model, world and
        batch resolve from, before any candidate is judged against the budget."""
        return _blanked(self.source.text, (self.memory_span,) if self.memory_span else ())

    def pipeline_text(
        self, block: str, budget: str | None, *, precision: bool = True, blank: bool = True
    ) -> str:
        """A pipeline candidate: the kept statements (`precision`: with the file's), the
        file's `pipeline` block dropped too, and `block` after them."""
        assert self.pipeline is not None
        kept = self.kept_text(blank=blank, precision=precision, extra=(self.pipeline,))
        return kept + "\n" + "".join(f"memory {budget}\n" if budget else "") + block + "\n"

    def text(self, k: Knobs, cfg: GPTConfig | None, budget: str | None, *, blank=True) -> str:
        """The candidate as a whole schedule (cfg: the model, for layer names)."""
        kept = self.kept_text(blank=blank, precision=k.precision is None and k.policy is None)
        return kept + "\n" + knob_text(k, cfg, budget)


def kept_policy(declared: Numerics, file: Strategy, kind: Strategy) -> Numerics | None:
    """The policy a candidate of `kind` declares to compute what the file computes (the same
    effective numerics: ir/spec.py `Numerics.effective`), `declared` itself where the file's
    statement already means that; None where no policy can (DDP gathers nothing, so a file
    that gathers in bf16 has no DDP twin with its numerics)."""
    want = declared.effective(file)
    if declared.effective(kind) == want:
        return declared
    gather = want.gather if kind is Strategy.FSDP else Dtype.FP32
    policy = replace(declared, compute=want.compute, gather=gather, reduce=want.reduce)
    return policy if policy.effective(kind) == want else None


def policy_text(n: Numerics, kind: Strategy) -> str:
    """A `precision` statement with every dtype `kind` reads written out."""
    keys = [f"compute = {n.compute}"]
    if kind is Strategy.FSDP:
        keys.append(f"gather = {n.gather}")
    if kind is not Strategy.SINGLE:
        keys.append(f"reduce = {n.reduce}")
    return "precision { " + "  ".join(keys) + " }"


def _blanked(text: str, drop, blank: bool = True) -> str:
    """`text` without the statements at `drop` and their comments (blanked or cut)."""
    out, at = [], 0
    for sp in sorted(drop):
        start = comments_above(text, sp.start)  # they describe what is dropped
        out.append(text[at:start])
        end = sp.end
        eol = text.find("\n", end)
        eol = len(text) if eol < 0 else eol
        if text[end:eol].strip().startswith("#") or not text[end:eol].strip():
            end = eol  # the statement's own comment goes with it
        cut = text[start:end]
        out.append("".join(c if c == "\n" else " " for c in cut) if blank else "")
        at = end
    out.append(text[at:])
    return "".join(out)


def knob_text(k: Knobs, cfg: GPTConfig | None, budget: str | None) -> str:
    """The statements a candidate writes after the file's own (cfg: the model, for a bucket
    per layer)."""
    lines = [f"micro {k.micro}"]
    if budget:
        lines.append(f"memory {budget}")
    if k.precision:
        lines.append(f"precision {k.precision}")
    elif k.policy is not None:
        lines.append(policy_text(k.policy, Strategy(k.strategy)))
    if k.strategy == "ddp":
        lines += _ddp_block(k, cfg)
    elif k.strategy == "fsdp":
        lines += _fsdp_block(k)
    return "\n".join(lines) + "\n"


def _switch(on: bool) -> str:
    return "on" if on else "off"


def _ddp_block(k: Knobs, cfg: GPTConfig | None) -> list[str]:
    lines = ["ddp {"]
    if k.layout == "cap":
        lines.append(f"  bucket_cap {fmt_size(k.cap)}")
    elif k.layout == "one":
        lines.append("  bucket b1 = head .. embed")
    else:
        assert cfg is not None, "a bucket per layer names the model's layers"
        order = list(reversed(cfg.layers))  # gradient-ready order: head first, embed last
        for i, layer in enumerate(order):
            lines.append(f"  bucket b{i + 1} = {layer}")
    return lines + ["  overlap on", f"  no_sync {_switch(k.no_sync)}", "}"]


def _fsdp_block(k: Knobs) -> list[str]:
    lines = ["fsdp {", "  unit tied = wte.weight keep"]
    last = len(k.groups) - 1
    for i, (a, b) in enumerate(k.groups):
        refs = [f"h.{a}" if a == b else f"h.{a} .. h.{b}"]
        if i == 0:
            refs.insert(0, "wpe.weight")
        if i == last:
            refs.append("head")
        lines.append(f"  unit u{i + 1} = {', '.join(refs)}{' keep' if k.keep_all else ''}")
    return lines + [
        f"  prefetch forward {k.prefetch}",
        f"  prefetch backward {k.prefetch}",
        f"  reshard_after_forward {_switch(k.reshard)}",
        f"  no_sync {_switch(k.no_sync)}",
        "}",
    ]


def fmt_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# -- the space ------------------------------------------------------------------------------------


def micros(seqs: int, world: int) -> list[int]:
    """Every micro size that divides the global batch over the ranks, largest first."""
    per_rank = seqs // world if seqs % world == 0 else 0
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def partitions(n_layer: int) -> list[tuple[tuple[int, int], ...]]:
    """Contiguous groupings of the blocks into units: all 2^(L-1) of them for small models,
    else the most balanced grouping into n units for every n in 1..L."""
    if n_layer < 1:
        return [()]
    if 2 ** (n_layer - 1) <= MAX_COMPOSITIONS:
        out = []
        for mask in range(2 ** (n_layer - 1)):
            groups, a = [], 0
            for i in range(n_layer - 1):
                if mask >> i & 1:
                    groups.append((a, i))
                    a = i + 1
            groups.append((a, n_layer - 1))
            out.append(tuple(groups))
        return sorted(out, key=len)
    out = []
    for n in range(1, n_layer + 1):
        q, r = divmod(n_layer, n)
        groups, a = [], 0
        for i in range(n):
            size = q + (1 if i < r else 0)
            groups.append((a, a + size - 1))
            a += size
        out.append(tuple(groups))
    return out


def candidates(
    n_layer: int,
    seqs: int,
    world: int,
    precisions: tuple[str | None, ...] = (None,),
    strategies: tuple[str, ...] = ("ddp", "fsdp"),
) -> list[Knobs]:
    """The whole space, deduplicated where two knob sets are the same schedule by
    construction (no_sync means nothing with one micro-step)."""
    out: dict[Knobs, None] = {}  # in order of first appearance
    for prec in precisions:
        for m in micros(seqs, world):
            k_steps = seqs // (m * world)
            syncs = (True, False) if k_steps > 1 else (False,)
            if world == 1 or "single" in strategies:
                out.setdefault(Knobs("single", m, prec))
            if world == 1:
                continue
            if "ddp" in strategies:
                out.update(dict.fromkeys(_ddp_knobs(m, prec, syncs)))
            if "fsdp" in strategies:
                out.update(dict.fromkeys(_fsdp_knobs(m, prec, syncs, n_layer)))
    return list(out)


def _ddp_knobs(m: int, prec: str | None, syncs: tuple[bool, ...]) -> Iterator[Knobs]:
    for ns in syncs:
        for cap in BUCKET_CAPS:
            yield Knobs("ddp", m, prec, layout="cap", cap=cap, no_sync=ns)
        yield Knobs("ddp", m, prec, layout="per-layer", no_sync=ns)
        yield Knobs("ddp", m, prec, layout="one", no_sync=ns)


def _fsdp_knobs(m: int, prec: str | None, syncs: tuple[bool, ...], n_layer: int) -> Iterator[Knobs]:
    for groups in partitions(n_layer):
        for pf in PREFETCH:
            for keep_all in (False, True):
                for reshard in (True, False) if not keep_all else (True,):
                    for ns in syncs:
                        yield Knobs(
                            "fsdp",
                            m,
                            prec,
                            groups=groups,
                            prefetch=pf,
                            reshard=reshard,
                            keep_all=keep_all,
                            no_sync=ns,
                        )

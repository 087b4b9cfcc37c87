"""AST -> Spec: names resolved, numbers checked, coverage proven, batch arithmetic done.

This pass judges everything a schedule declares (the graph pass judges what it does):
names exist, values are in range, every parameter is in exactly one bucket or unit, the
global batch is micro x accumulation x world exactly, the tied weight sits where both its
users can see it. All findings are collected before the stage fails.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from schedc.ir.op import COMM, COMPUTE, Kind, Op, OpSyntaxError
from schedc.ir.source import Span
from schedc.ir.spec import (
    POLICIES,
    TIED,
    BucketSpec,
    DDPSpec,
    Dtype,
    FSDPSpec,
    InstrSpec,
    Mesh,
    MiB,
    Numerics,
    ProgramSpec,
    Spec,
    Strategy,
    UnitSpec,
)
from schedc.lang.diagnostics import Diagnostic, Diagnostics, Note, did_you_mean
from schedc.lang.params import auto_buckets, group_by_layer, ready_position
from schedc.lang.syntax import (
    DDP,
    FSDP,
    Batch,
    BucketCap,
    BucketDecl,
    Data,
    Field,
    LossChunk,
    Memory,
    MeshDecl,
    Model,
    Name,
    Num,
    Optimizer,
    OtherSetting,
    Precision,
    Prefetch,
    Program,
    Recompute,
    Ref,
    Schedule,
    Setting,
    Size,
    StreamDecl,
    Toggle,
    UnitDecl,
)
from schedc.model.arch import SIZES, GPTConfig
from schedc.model.config import DataConfig, OptimConfig

# -- the pass -----------------------------------------------------------------------------------

# (min, max) of each plain setting; max keeps arithmetic sane and catches typos like 1e40
LIMITS = {
    "world": (1, 1 << 16),
    "micro": (1, 1 << 24),
    "accumulate": (1, 1 << 20),
    "steps": (1, 1 << 30),
    "seed": (0, (1 << 63) - 1),
}
CHUNK = (1, 1 << 24)  # tokens per chunk of the head's loss (`loss chunk N`)
UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
}
# the statements each block takes, as the grammar spells their keywords
BLOCK_KEYS = {
    "ddp": ("bucket", "bucket_cap", "overlap", "no_sync"),
    "fsdp": ("unit", "prefetch", "reshard_after_forward", "no_sync", "recompute"),
}
# words inside a block's statements, which a misspelling may be nearest to
BLOCK_WORDS = {
    "ddp": {"first": "it follows bucket_cap: `bucket_cap 25 MiB first 1 MiB`"},
    "fsdp": {"keep": "it ends a unit: `unit tied = wte.weight keep`"},
}
BLOCK_ARTICLE = {"ddp": "a ddp", "fsdp": "an fsdp"}  # as said aloud: "an eff-ess-dee-pee"
# ops in one step's graph: compile time and memory grow with them (measured on a 2-core CPU:
# 34,817 ops in 10.8 s and 250 MB; 280,000 took 90 s and 1.7 GB), so a step is bounded to
# what compiles in about 10 s and 300 MB: GPT-2 124M FSDP with a unit a layer and 300
# micro-steps, or one process with 1,100
MAX_OPS = 32_000
DEFAULT_STEPS = 20
DEFAULT_SEED = 1337
STREAM_KINDS = {k.value: k for k in Kind}


@dataclass(frozen=True)
class Overrides:
    """Command-line flags, which take precedence over the file."""

    model: str | None = None
    steps: int | None = None
    seed: int | None = None
    precision: str | None = None  # a named policy: replaces the file's whole `precision`
    tf32: bool | None = None
    compile: bool | None = None

    def diagnostics(self) -> list[Diagnostic]:
        """The flags judged by the file's own rules (LIMITS, SIZES) with the file's codes.

        A flag has no line to point at: its diagnostics are placed at `schedc: --FLAG VALUE`,
        as a file's are at `path:line:col`. The resolver reports these too, so every caller
        of the compiler gets them; the CLI asks first, to say them once, not once per file.
        """
        out = []
        for key in ("steps", "seed"):
            v = getattr(self, key)
            if v is not None and (bad := range_error(key, v, *LIMITS[key])) is not None:
                out.append(Diagnostic("value-range", bad, path=flag_place(key, v)))
        if self.model is not None and self.model not in SIZES:
            out.append(
                Diagnostic(
                    "unknown-model",
                    f"unknown model '{self.model}'",
                    path=flag_place("model", self.model),
                    hint=did_you_mean(self.model, SIZES) or f"known sizes: {', '.join(SIZES)}",
                )
            )
        return out


def flag_place(flag: str, value) -> str:
    """Where a diagnostic about a command-line value is reported: `schedc: --steps -5`."""
    text = str(value)
    return f"schedc: --{flag} {text if len(text) <= 40 else text[:20] + '...'}"


def range_error(what: str, v: int, lo: int, hi: int, shown: str | None = None) -> str | None:
    """The message for an integer outside [lo, hi] (None when inside), the same for a number
    written in a file and one given as a flag."""
    if lo <= v <= hi:
        return None
    bound = f">= {lo}" if v < lo else f"<= {hi:,}"
    if shown is None:  # `shown`: the text as written, for numbers too long to format
        shown = (
            f"{v:,}" if abs(v) < 10**15 else (str(v) if len(str(v)) <= 40 else f"{str(v)[:20]}...")
        )
    return f"{what} must be {bound}, got {shown}"


def resolve(ast: Schedule, overrides: Overrides = Overrides()) -> tuple[Spec, list]:
    """The resolved schedule and its warnings; raises CompileError on any error."""
    r = _Resolver(ast, overrides)
    spec = r.run()
    return spec, r.diag.warnings


MAX_SIZE = 1 << 60  # bytes: a size of 1 EiB or more is a typo, and overflows int64 sums


def size_bytes(number: float, unit: str, what: str = "a size", text: str | None = None) -> int:
    """A size in bytes (`memory 80 GiB`, `tune --budget 80GiB`): a whole number of bytes,
    at least 1 and below MAX_SIZE, or ValueError saying so."""
    v = number * UNITS[unit]
    shown = f"{text if text is not None else f'{number:g}'} {unit}".rstrip()
    if v >= MAX_SIZE:
        raise ValueError(f"{what} must be below 1 EiB (2^60 bytes), got {shown}")
    if not v >= 1 or v != int(v):
        raise ValueError(f"{what} must be a positive whole number of bytes, got {shown}")
    return int(v)


def int_of(diag: Diagnostics, num: Num, what: str, lo: int, hi: int) -> int | None:
    """A whole number in [lo, hi] as written, or None after reporting why not."""
    shown = num.text if len(num.text) <= 40 else f"{num.text[:20]}..."
    if not num.is_int:
        diag.error(
            "value-range",
            f"{what} must be a whole number written in digits, not {shown}",
            num.span,
        )
        return None
    huge = len(num.text) > 64  # int() refuses thousands of digits; out of every range
    v = int(num.text) if not huge else (lo - 1 if num.text.startswith("-") else hi + 1)
    if (bad := range_error(what, v, lo, hi, shown if huge else None)) is not None:
        diag.error("value-range", bad, num.span, hint=_range_hint(what, lo, hi))
        return None
    return v


def size_of(diag: Diagnostics, size: Size, what: str) -> int | None:
    """A size in bytes as written (`25 MiB`), or None after reporting why not."""
    if size.unit not in UNITS:
        diag.error(
            "value-range",
            f"unknown unit '{size.unit}'",
            size.span,
            hint="use B, KB, MB, GB, KiB, MiB or GiB",
        )
        return None
    try:
        return size_bytes(size.number.value, size.unit, what, size.number.text)
    except ValueError as e:
        diag.error("value-range", str(e), size.span)
        return None


def one_number(diag: Diagnostics, f: Field) -> Num | None:
    """The one number of `key = N`, or None after reporting that it takes one."""
    if len(f.values) != 1 or not isinstance(f.values[0], Num):
        diag.error("value-range", f"'{f.key.text}' takes one number", f.span)
        return None
    return f.values[0]


def ops_per_step(
    model: GPTConfig, accum: int, strategy, recompute: frozenset[str], hsdp: bool
) -> int:
    """At most the ops of one step's graph (passes/graph.py): per micro-step a forward and
    a backward of every layer and each recompute; DDP's all-reduce of each bucket, FSDP's
    two gathers and two frees of each unit and its reduce-scatter (and HSDP's all-reduce),
    every micro-step (fewer under no_sync or for kept units); the update."""
    layers = len(model.layers)
    n = accum * (2 * layers + len(recompute)) + 1
    if isinstance(strategy, DDPSpec):
        n += accum * len(strategy.buckets)
    elif isinstance(strategy, FSDPSpec):
        n += accum * len(strategy.units) * (6 if hsdp else 5)
    return n


class _Resolver:
    def __init__(self, ast: Schedule, overrides: Overrides = Overrides()):
        self.ov = overrides
        self.ast = ast
        self.src = ast.source
        self.diag = Diagnostics(self.src)
        self.diag.extend(overrides.diagnostics())  # the flags, by the file's rules
        self.seen: dict[str, Span] = {}
        self.refs_ok = True
        self.replicated = False  # a mesh with replicate > 1: FSDP programs all-reduce units

    # -- helpers --------------------------------------------------------------------------------

    def err(self, code: str, msg: str, span: Span | None, hint: str | None = None, notes=()):
        self.diag.error(code, msg, span, hint, notes)

    def once(self, key: str, span: Span, what: str) -> bool:
        """Record a statement that may appear once; report the repeat."""
        if key in self.seen:
            first = self.seen[key]
            self.err(
                "duplicate",
                f"{what} is given twice",
                span,
                hint="keep one of them",
                notes=(Note(f"first given at line {first.line}", first),),
            )
            return False
        self.seen[key] = span
        return True

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> Spec:
        ast = self.ast
        by_type: dict[type, list] = {}
        for s in ast.stmts:
            by_type.setdefault(type(s), []).append(s)

        def single(t, key, what):
            items = by_type.get(t, [])
            for item in items:
                self.once(key, item.span, what)
            return items[0] if items else None

        model_name, model = self.model(single(Model, "model", "the model"))
        settings: dict[str, int | None] = {}
        for s in by_type.get(Setting, []):
            if self.once(s.key, s.span, f"'{s.key}'"):
                lo, hi = LIMITS[s.key]
                settings[s.key] = int_of(self.diag, s.value, s.key, lo, hi)
        batch = single(Batch, "batch", "the batch")
        seqs = seq_len = None
        if batch:
            seqs = int_of(self.diag, batch.sequences, "global batch sequences", 1, 1 << 31)
            seq_len = int_of(self.diag, batch.tokens, "tokens per sequence", 1, 1 << 20)
        memory = None
        if (m := single(Memory, "memory", "the memory budget")) is not None:
            memory = size_of(self.diag, m.size, "memory")
        data = self.data(single(Data, "data", "the data source"))
        optim = self.optimizer(single(Optimizer, "optimizer", "the optimizer"))
        toggles = {}
        for t in by_type.get(Toggle, []):  # top level: tf32, compile
            if self.once(t.key, t.span, f"'{t.key}'"):
                toggles[t.key] = t.value.on

        missing = [
            k
            for k, present in (
                ("model", model_name is not None),
                ("world", "world" in self.seen),
                ("batch", batch is not None),
            )
            if not present
        ]
        if not ("micro" in self.seen or "accumulate" in self.seen):
            missing.append("micro")
        for key in missing:  # about the whole file, so no line to point at
            self.err(
                "missing-setting", f"the schedule has no '{key}'", None, hint=_MISSING_HINT[key]
            )

        world = settings.get("world")
        micro, accum = self.batch_arithmetic(seqs, world, settings)
        if model is not None and accum is not None and 2 * accum * len(model.layers) > MAX_OPS:
            self.too_many_ops(accum, 2 * accum * len(model.layers), "forward and backward")
            micro, accum = None, None
        if model is not None and seq_len is not None and seq_len > model.block_size:
            self.err(
                "context-length",
                f"sequences of {seq_len:,} tokens do not fit the model's context of "
                f"{model.block_size:,}",
                batch.tokens.span,
                hint=f"use at most {model.block_size} tokens, or raise `block` in the model",
            )

        ddps, fsdps = by_type.get(DDP, []), by_type.get(FSDP, [])
        strategy = None
        if ddps and fsdps:
            self.err(
                "conflict",
                "a schedule is either DDP or FSDP, not both",
                fsdps[0].span,
                hint="keep one of the ddp and fsdp blocks",
                notes=(Note("the ddp block is here", ddps[0].span),),
            )
        elif model is not None:
            if ddps:
                single(DDP, "ddp", "the ddp block")
                strategy = self.ddp(ddps[0], model)
            elif fsdps:
                single(FSDP, "fsdp", "the fsdp block")
                strategy = self.fsdp(fsdps[0], model)
        if world is not None and world > 1 and not ddps and not fsdps:
            self.err(
                "missing-setting",
                f"world {world} needs a ddp or fsdp block to say how gradients are combined",
                self.seen["world"],
                hint="add `ddp { bucket_cap 25 MiB }`, for one",
            )

        mesh = self.mesh(single(MeshDecl, "mesh", "the mesh"), world, strategy)
        self.replicated = mesh is not None and mesh.replicate > 1
        numerics = self.numerics(single(Precision, "precision", "the precision"), strategy, toggles)
        if (lc := single(LossChunk, "loss", "`loss chunk`")) is not None:
            # not part of a precision policy: --precision keeps it
            numerics = replace(
                numerics, loss_chunk=int_of(self.diag, lc.tokens, "loss chunk", *CHUNK)
            )
        recompute = self.recompute(
            single(Recompute, "recompute", "`recompute`"),
            next((s for s in fsdps[0].stmts if isinstance(s, Recompute)), None) if fsdps else None,
            model,
            strategy,
        )
        if model is not None and accum is not None:
            n = ops_per_step(
                model, accum, strategy, recompute, mesh is not None and mesh.replicate > 1
            )
            if n > MAX_OPS:
                self.too_many_ops(accum, n, "forward, backward, collective and free")
                accum = None
        streams = self.streams(by_type.get(StreamDecl, []), strategy)
        programs = self.programs(by_type.get(Program, []), model, strategy, world, accum, streams)
        self.diag.raise_if_any()
        return Spec(
            source=self.src,
            model_name=model_name,
            model=model,
            world=world,
            seqs=seqs,
            seq_len=seq_len,
            micro=micro,
            accum=accum,
            steps=_first(self.ov.steps, settings.get("steps"), DEFAULT_STEPS),
            seed=_first(self.ov.seed, settings.get("seed"), DEFAULT_SEED),
            data=data,
            optim=optim,
            memory=memory,
            strategy=strategy,
            streams=streams,
            programs=programs,
            numerics=numerics,
            recompute=recompute,
            where=dict(self.seen),
            declared_mesh=mesh,
        )

    def too_many_ops(self, accum: int, n: int, what: str) -> None:
        self.err(
            "value-range",
            f"{accum:,} micro-steps make {n:,} {what} ops per step; schedc compiles at most "
            f"{MAX_OPS:,} (about 10 s and 300 MB on a 2-core CPU)",
            self.seen.get("micro") or self.seen.get("accumulate"),
            hint="use a larger `micro` (fewer micro-steps per update)",
        )

    def model(self, m: Model | None) -> tuple[str | None, GPTConfig | None]:
        if self.ov.model is not None:  # an unknown one is reported by Overrides.diagnostics
            return self.ov.model, SIZES.get(self.ov.model)
        if m is None:
            return None, None
        base = None
        if m.name is not None:
            base = SIZES.get(m.name.text)
            if base is None:
                self.err(
                    "unknown-model",
                    f"unknown model '{m.name.text}'",
                    m.name.span,
                    hint=did_you_mean(m.name.text, SIZES) or f"known sizes: {', '.join(SIZES)}",
                )
                return m.name.text, None
        read = _read_keyed(self, m.fields, MODEL)
        values = read.values
        if base is None:
            need = [k for k in ("n_layer", "n_head", "n_embd") if k not in values]
            if need:
                self.err(
                    "missing-setting",
                    f"a model without a size name needs {', '.join(need)}",
                    m.span,
                    hint="name a size (`model gpt2`) or give n_layer, n_head, n_embd",
                )
                return "custom", None
            base = GPTConfig()
        if not read.complete:
            return (m.name.text if m.name else "custom"), None  # an error was reported
        try:
            cfg = base.with_overrides(**values)
        except ValueError as e:
            self.err(
                "model-config",
                str(e),
                m.span,
                hint="n_embd must be a multiple of n_head (head size = n_embd / n_head)",
            )
            return "custom", None
        name = m.name.text if m.name else "custom"
        return (f"{name}*" if values and m.name else name), cfg

    def batch_arithmetic(self, seqs, world, settings) -> tuple[int | None, int | None]:
        micro, accum = settings.get("micro"), settings.get("accumulate")
        if (
            seqs is None
            or world is None
            or ("micro" in self.seen and micro is None)
            or ("accumulate" in self.seen and accum is None)
        ):
            return micro, accum
        if micro is None and accum is None:
            return None, None
        if micro is not None and accum is not None:
            if micro * accum * world != seqs:
                self.err(
                    "batch-arithmetic",
                    f"micro {micro} x accumulate {accum} x world {world} = "
                    f"{micro * accum * world:,} sequences, but the global batch is {seqs:,}",
                    self.seen["accumulate"],
                    hint=_batch_hint(seqs, world),
                )
                return None, None
            return micro, accum
        if micro is not None:
            if seqs % (micro * world):
                self.err(
                    "batch-arithmetic",
                    f"global batch {seqs:,} is not micro {micro} x world {world} x a whole "
                    "number of micro-steps",
                    self.seen["micro"],
                    hint=_batch_hint(seqs, world),
                )
                return None, None
            return micro, seqs // (micro * world)
        if seqs % (accum * world):
            self.err(
                "batch-arithmetic",
                f"global batch {seqs:,} is not accumulate {accum} x world {world} x a whole "
                "number of sequences",
                self.seen["accumulate"],
                hint=_batch_hint(seqs, world),
            )
            return None, None
        return seqs // (accum * world), accum

    def mesh(self, m: MeshDecl | None, world: int | None, strategy) -> Mesh | None:
        """`mesh R x S`: the world as replicate x shard; R x S must be the world, and only
        FSDP shards (DDP's mesh is `world x 1`)."""
        if m is None:
            return None
        hi = LIMITS["world"][1]
        r = int_of(self.diag, m.replicate, "mesh replicate size", 1, hi)
        s = int_of(self.diag, m.shard, "mesh shard size", 1, hi)
        if r is None or s is None or world is None:
            return None
        if r * s != world:
            self.err(
                "mesh-size",
                f"mesh {r} x {s} is {r * s} rank{'s' * (r * s != 1)}, but the world is {world}",
                m.span,
                hint=_mesh_hint(world),
            )
            return None
        if isinstance(strategy, DDPSpec) and s > 1:
            self.err(
                "mesh-ddp",
                f"a ddp schedule shards nothing: its mesh is {world} x 1, not {r} x {s}",
                m.span,
                hint=f"write `mesh {world} x 1`, or use an fsdp block to shard over {s} ranks",
            )
            return None
        return Mesh(r, s)

    def data(self, d: Data | None) -> DataConfig:
        """The data source resolved (DataConfig.resolved): the spec holds its meaning."""
        if d is None:
            return DataConfig().resolved()
        if isinstance(d.source, Name):
            if d.source.text != "corpus":
                self.err(
                    "unknown-name",
                    f"unknown data source '{d.source.text}'",
                    d.source.span,
                    hint='write `data corpus` for the embedded corpus, or a "quoted/path"',
                )
            return DataConfig("corpus", "text")
        if not d.source.text:
            self.err("value-range", "the data path is empty", d.source.span)
        return DataConfig(d.source.text, d.kind).resolved()

    def optimizer(self, o: Optimizer | None) -> OptimConfig:
        if o is None:
            return OptimConfig()
        if o.name.text != "adamw":
            self.err(
                "unknown-name",
                f"unknown optimizer '{o.name.text}'",
                o.name.span,
                hint="schedc runs `adamw` (decoupled weight decay, as in GPT-2 training)",
            )
        values = _read_keyed(self, o.fields, OPTIMIZER).values
        try:
            return OptimConfig(**values)
        except ValueError as e:
            self.err("value-range", f"optimizer: {e}", o.span)
            return OptimConfig()

    def numerics(self, p: Precision | None, strategy, toggles: dict[str, bool]) -> Numerics:
        """`precision NAME { compute = .., gather = .., reduce = .. }`, `tf32`, `compile`."""
        tf32 = _first(self.ov.tf32, toggles.get("tf32"), _UNSET)
        compile_ = _first(self.ov.compile, toggles.get("compile"), False)
        tf32 = None if tf32 is _UNSET else tf32
        if self.ov.precision is not None:  # --precision NAME replaces the file's policy
            if self.ov.precision not in POLICIES:
                self.err(
                    "unknown-name",
                    f"--precision {self.ov.precision}: no such policy",
                    None,
                    hint=f"policies: {', '.join(POLICIES)}",
                )
                return Numerics(tf32=tf32, compile=compile_)
            return replace(POLICIES[self.ov.precision], tf32=tf32, compile=compile_)
        if p is None:
            return Numerics(tf32=tf32, compile=compile_)
        base = POLICIES["fp32"]
        if p.name is not None:
            if p.name.text in POLICIES:
                base = POLICIES[p.name.text]
            else:
                self.err(
                    "unknown-name",
                    f"unknown precision policy '{p.name.text}'",
                    p.name.span,
                    hint=did_you_mean(p.name.text, POLICIES)
                    or f"policies: {', '.join(POLICIES)}; or write the dtypes: "
                    "`precision { compute = bf16  gather = bf16  reduce = fp32 }`",
                )
        read = _read_keyed(self, p.fields, PRECISION)
        chosen, where = read.values, read.spans
        for key, dt in chosen.items():
            if dt is Dtype.FP16:
                self.err(
                    "dtype",
                    f"{key} = fp16 needs dynamic loss scaling (fp16 overflows "
                    "where bf16 does not), which schedc does not do",
                    where[key],
                    hint=f"use `{key} = bf16`: the same speed, fp32's range",
                )
        if "gather" in chosen and Strategy.of(strategy) is not Strategy.FSDP:
            self.err(
                "conflict",
                f"gather is the dtype FSDP units are all-gathered in; "
                f"{Strategy.of(strategy).a_label} schedule gathers none",
                where["gather"],
                hint="drop `gather`, or use an fsdp block",
            )
        numerics = replace(base, **chosen, tf32=tf32, compile=compile_)
        if numerics.gather is not Dtype.FP32 and numerics.compute is Dtype.FP32:
            self.err(
                "conflict",
                f"gathering in {numerics.gather} rounds the weights to it, but compute is fp32",
                where.get("gather") or where.get("compute") or p.span,
                hint=f"compute in {numerics.gather} too, or gather in fp32",
            )
        return numerics

    # -- recomputation -------------------------------------------------------------------------

    def recompute(
        self, top: Recompute | None, in_fsdp: Recompute | None, cfg: GPTConfig | None, strategy
    ) -> frozenset[str]:
        """The layers that recompute: named as layers and ranges at top level, as units
        inside the fsdp block (every layer that reads the unit's parameters)."""
        out: set[str] = set()
        if cfg is None:
            return frozenset()
        if top is not None:
            for ref in top.refs:
                names = [n for n in (ref.first, ref.last) if n is not None]
                found = [self.layer_name(n, cfg) for n in names]
                if None in found:
                    continue
                idx = sorted(cfg.layer_index(x) for x in found)  # a range in either direction
                out.update(cfg.layers[idx[0] : idx[-1] + 1])
        if in_fsdp is not None and isinstance(strategy, FSDPSpec):
            if self.once("fsdp.recompute", in_fsdp.span, "`recompute` in the fsdp block"):
                units = {u.name: u for u in strategy.units}
                for ref in in_fsdp.refs:
                    if ref.last is not None:
                        self.err(
                            "syntax",
                            "inside fsdp, recompute names units one by one, not a range",
                            ref.span,
                            hint=f"write `recompute {ref.first.text}, {ref.last.text}`, or name "
                            "layers with a top-level `recompute h.0 .. h.3`",
                        )
                    elif ref.first.text not in units:
                        self.err(
                            "unknown-name",
                            f"unknown unit '{ref.first.text}'",
                            ref.first.span,
                            hint=did_you_mean(ref.first.text, units)
                            or f"units: {', '.join(units)}",
                        )
                    else:
                        out.update(units[ref.first.text].layers)
        return frozenset(out)

    # -- references to layers and parameters --------------------------------------------------

    def refs(
        self, refs: tuple[Ref, ...], cfg: GPTConfig, *, params: bool
    ) -> list[tuple[str, Span]]:
        """Resolve refs to (parameter, span of the ref) in model order within each ref."""
        errors_before = len(self.diag.errors)
        out = self._refs(refs, cfg, params=params)
        if len(self.diag.errors) > errors_before:
            self.refs_ok = False  # coverage would only repeat the same mistake
        return out

    def _refs(
        self, refs: tuple[Ref, ...], cfg: GPTConfig, *, params: bool
    ) -> list[tuple[str, Span]]:
        out: list[tuple[str, Span]] = []
        for ref in refs:
            if ref.last is None:
                layers = self.layer_or_param(ref.first, cfg, params=params)
                if layers is None:
                    continue
                out += [(p, ref.span) for p in layers]
                continue
            a, b = (self.layer_name(n, cfg) for n in (ref.first, ref.last))
            if a is None or b is None:
                continue
            ia, ib = sorted((cfg.layer_index(a), cfg.layer_index(b)))  # either direction
            for layer in cfg.layers[ia : ib + 1]:
                out += [(p.name, ref.span) for p in cfg.layer_params(layer)]
        return out

    def layer_name(self, n: Name, cfg: GPTConfig) -> str | None:
        if n.text in cfg.layers:
            return n.text
        self.unknown_layer(n, cfg, params=False)
        return None

    def layer_or_param(self, n: Name, cfg: GPTConfig, *, params: bool) -> list[str] | None:
        if n.text in cfg.layers:
            return [p.name for p in cfg.layer_params(n.text)]
        if params and any(p.name == n.text for p in cfg.params):
            return [n.text]
        self.unknown_layer(n, cfg, params=params)
        return None

    def unknown_layer(self, n: Name, cfg: GPTConfig, *, params: bool) -> None:
        text = n.text
        if text.startswith("h.") and text[2:].isdigit():
            self.err(
                "layer-range",
                f"the model has no layer {text}",
                n.span,
                hint=f"its blocks are h.0 .. h.{cfg.n_layer - 1}",
            )
            return
        if text in ("lm_head", "lm_head.weight"):
            self.err(
                "unknown-name",
                f"'{text}' is not a parameter of its own",
                n.span,
                hint="lm_head is tied to the embedding: name wte.weight (or the layer embed)",
            )
            return
        names = list(cfg.layers) + ([p.name for p in cfg.params] if params else [])
        what = "layer or parameter" if params else "layer"
        self.err(
            "unknown-name",
            f"unknown {what} '{text}'",
            n.span,
            hint=(None if self.diag.full else did_you_mean(text, names))  # full: unkept
            or f"layers are embed, h.0 .. h.{cfg.n_layer - 1}, head",
        )

    def groups(self, decls, cfg: GPTConfig, what: str) -> tuple[list, list]:
        """Buckets or units with their own names, and each as (name, span, resolved refs);
        a name defined twice is an error."""
        names: dict[str, Span] = {}
        kept, groups = [], []
        for d in decls:
            if d.name.text in names:
                self.err(
                    "duplicate",
                    f"{what} '{d.name.text}' is defined twice",
                    d.name.span,
                    hint=f"give each {what} its own name",
                    notes=(Note("first defined here", names[d.name.text]),),
                )
                self.refs_ok = False  # its layers would be reported uncovered: the same mistake
                continue
            names[d.name.text] = d.name.span
            kept.append(d)
            groups.append((d.name.text, d.span, self.refs(d.refs, cfg, params=True)))
        return kept, groups

    def cover(
        self,
        groups: list[tuple[str, Span, list[tuple[str, Span]]]],
        cfg: GPTConfig,
        block_span: Span,
        what: str,
    ) -> dict[str, str]:
        """Prove every parameter is in exactly one group; returns param -> group."""
        owner: dict[str, tuple[str, Span]] = {}
        # one finding per ref and group it repeats, noting where the first repeat was given
        repeats: dict[tuple[Span, str, str], tuple[Span, list[str]]] = {}
        for gname, _gspan, items in groups:
            for param, span in items:
                if param in owner:
                    other, ospan = owner[param]
                    repeats.setdefault((span, gname, other), (ospan, []))[1].append(param)
                    continue
                owner[param] = (gname, span)
        for (span, gname, other), (ospan, params) in repeats.items():
            names = group_by_layer(params, cfg)
            listed = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            where = "twice in" if other == gname else f"in both {what} '{other}' and"
            self.err(
                "double-cover",
                f"{listed} {'is' if len(names) == 1 else 'are'} {where} {what} '{gname}'",
                span,
                hint=f"a parameter belongs to exactly one {what}",
                notes=(Note(f"already in '{other}' here", ospan),),
            )
        missing = [p for p in cfg.params if p.name not in owner]
        if missing:
            names = group_by_layer([p.name for p in missing], cfg)
            listed = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            self.err(
                "uncovered",
                f"{listed} {'is' if len(names) == 1 else 'are'} in no {what}",
                block_span,
                hint=f"every parameter must be in exactly one {what}: add {names[0]} to one",
            )
        return {p: g for p, (g, _) in owner.items()}

    # -- DDP --------------------------------------------------------------------------------------

    def ddp(self, block: DDP, cfg: GPTConfig) -> DDPSpec:
        stmts = self.block_stmts(block.stmts, "ddp")
        buckets = [s for s in stmts if isinstance(s, BucketDecl)]
        caps = [s for s in stmts if isinstance(s, BucketCap)]
        toggles = self.toggles(stmts, "ddp")
        head_span = self.src.span(block.span.start, block.span.start + 3)
        for c in caps:
            self.once("bucket_cap", c.span, "bucket_cap")
        cap = None
        if buckets and caps:
            self.err(
                "conflict",
                "give buckets or a bucket_cap, not both",
                caps[0].span,
                hint="bucket_cap makes the buckets by itself; drop it or the buckets",
            )
        elif caps:
            cap = size_of(self.diag, caps[0].size, "bucket_cap")
            first = (
                size_of(self.diag, caps[0].first, "first bucket")
                if caps[0].first
                else min(cap or MiB, MiB)
            )
            if cap is None or first is None:
                return DDPSpec((), toggles.get("overlap", True), toggles.get("no_sync", True))
            specs = tuple(auto_buckets(cfg, cap, first))
            return DDPSpec(
                specs, toggles.get("overlap", True), toggles.get("no_sync", True), cap, first
            )
        elif not buckets and len(stmts) == len(block.stmts):  # else a misspelling said it
            self.err(
                "missing-setting",
                "the ddp block has no buckets",
                head_span,
                hint="add `bucket b1 = head, h.3 .. h.0, embed` or `bucket_cap 25 MiB`",
            )
        _, groups = self.groups(buckets, cfg, "bucket")
        if buckets and self.refs_ok:
            self.cover(groups, cfg, head_span, "bucket")
        ready = ready_position(cfg)
        specs = []
        for gname, gspan, items in groups:
            params = sorted({p for p, _ in items}, key=lambda p: ready[p])
            specs.append(
                BucketSpec(gname, tuple(params), gspan, sum(cfg.param(p).nbytes() for p in params))
            )
        self.bucket_order(specs, cfg, ready)
        return DDPSpec(tuple(specs), toggles.get("overlap", True), toggles.get("no_sync", True))

    def bucket_order(self, buckets: list[BucketSpec], cfg: GPTConfig, ready) -> None:
        """Warn when a bucket listed earlier completes later than one listed after it."""
        done = [max((ready[p] for p in b.params), default=0) for b in buckets]
        for i, b in enumerate(buckets):
            later = [j for j in range(i + 1, len(buckets)) if done[j] < done[i]]
            if not later or not b.params:
                continue
            last_param = max(b.params, key=lambda p: ready[p])
            if TIED in b.params and last_param == TIED:
                self.diag.warning(
                    "tied-late",
                    f"bucket '{b.name}' holds {TIED}, whose gradient is complete only after "
                    "bwd[embed] (the embedding and lm_head share it)",
                    b.span,
                    hint=f"move {TIED} to the last bucket, so '{b.name}' can launch earlier",
                )
            else:
                self.diag.warning(
                    "bucket-order",
                    f"bucket '{b.name}' is complete after '{buckets[later[0]].name}' but is "
                    "listed first, so both launch late",
                    b.span,
                    hint="list buckets in reverse layer order: the first bucket holds the last "
                    "layers",
                )

    def block_stmts(self, stmts, block: str) -> list:
        """The statements of a ddp or fsdp block that it takes; each other one is an
        [unknown-setting] naming what the block takes (the grammar parses the statements of
        both blocks, and a statement beginning with any name, in either)."""
        takes = BLOCK_KEYS[block]
        kept = []
        for s in stmts:
            key = _keyword(s)
            if key in takes:
                kept.append(s)
                continue
            owner = next((b for b, keys in BLOCK_KEYS.items() if key in keys), None)
            listed = f"{block} takes {', '.join(takes)}"
            if owner is not None:
                hint = f"`{key}` is {BLOCK_ARTICLE[owner]} setting; {listed}"
            else:  # a word that ends a line (`kep`) reads as a statement of its own
                words = BLOCK_WORDS[block].items()
                hint = did_you_mean(key, takes) or next(
                    (f"did you mean '{w}'? ({ex})" for w, ex in words if did_you_mean(key, [w])),
                    listed,
                )
            span = (
                s.key.span
                if isinstance(s, OtherSetting)
                else self.src.span(s.span.start, s.span.start + len(key))
            )
            self.err("unknown-setting", f"{BLOCK_ARTICLE[block]} block has no '{key}'", span, hint)
            self.refs_ok = False  # a misspelled bucket or unit: coverage would repeat it
        return kept

    def toggles(self, stmts, block: str) -> dict[str, bool]:
        out = {}
        for t in stmts:
            if isinstance(t, Toggle) and self.once(f"{block}.{t.key}", t.span, f"'{t.key}'"):
                out[t.key] = t.value.on
        return out

    # -- FSDP -------------------------------------------------------------------------------------

    def fsdp(self, block: FSDP, cfg: GPTConfig) -> FSDPSpec:
        stmts = self.block_stmts(block.stmts, "fsdp")
        units = [s for s in stmts if isinstance(s, UnitDecl)]
        toggles = self.toggles(stmts, "fsdp")
        head_span = self.src.span(block.span.start, block.span.start + 4)
        depth = {"forward": 1, "backward": 1}
        for p in (s for s in stmts if isinstance(s, Prefetch)):
            if self.once(f"prefetch.{p.direction}", p.span, f"prefetch {p.direction}"):
                v = int_of(self.diag, p.depth, f"prefetch {p.direction}", 0, 64)
                if v is not None:
                    depth[p.direction] = v
        if not units and len(stmts) == len(block.stmts):  # else a misspelling said it
            self.err(
                "missing-setting",
                "the fsdp block has no units",
                head_span,
                hint="add units, e.g. `unit tied = wte.weight keep` and `unit u1 = embed .. h.1`",
            )
        units, groups = self.groups(units, cfg, "unit")
        if units and self.refs_ok:
            self.cover(groups, cfg, head_span, "unit")
        specs = []
        order = {layer: i for i, layer in enumerate(cfg.layers)}
        for (gname, gspan, items), u in zip(groups, units):
            params = tuple(p.name for p in cfg.params if p.name in {q for q, _ in items})
            layers = sorted({layer for p in params for layer in cfg.users(p)}, key=order.get)
            idx = [order[x] for x in layers]
            if layers and not u.keep and idx != list(range(idx[0], idx[-1] + 1)):
                if TIED in params:
                    self.err(
                        "tied-param",
                        f"unit '{gname}' holds {TIED}, which embed and head both read, so it "
                        f"would stay gathered from {layers[0]} to {layers[-1]}",
                        gspan,
                        hint=f"give the tied weight a unit of its own that stays gathered: "
                        f"`unit tied = {TIED} keep`",
                    )
                else:
                    self.err(
                        "unit-contiguous",
                        f"unit '{gname}' is read by layers {', '.join(layers)}, which are not "
                        "adjacent",
                        gspan,
                        hint="make each unit a contiguous range of layers, or mark it `keep`",
                    )
            specs.append(
                UnitSpec(
                    gname,
                    params,
                    tuple(layers),
                    u.keep,
                    gspan,
                    sum(cfg.param(p).nbytes() for p in params),
                )
            )
        specs.sort(key=lambda s: (order[s.layers[0]] if s.layers else 0, not s.keep))
        return FSDPSpec(
            tuple(specs),
            depth["forward"],
            depth["backward"],
            toggles.get("reshard_after_forward", True),
            toggles.get("no_sync", False),
        )

    # -- streams and programs -----------------------------------------------------------------

    def streams(self, decls: list[StreamDecl], strategy) -> dict[Kind, str]:
        streams = {k: (COMM if k.is_collective else COMPUTE) for k in Kind}
        if isinstance(strategy, DDPSpec) and not strategy.overlap:
            streams[Kind.ALLREDUCE] = COMPUTE
        for d in decls:
            kind = STREAM_KINDS.get(d.kind.text)
            if kind is None:
                self.err(
                    "unknown-name",
                    f"unknown op kind '{d.kind.text}'",
                    d.kind.span,
                    hint=did_you_mean(d.kind.text, STREAM_KINDS)
                    or f"kinds: {', '.join(STREAM_KINDS)}",
                )
                continue
            if not self.once(f"stream.{kind.value}", d.span, f"the stream of {kind.value}"):
                continue
            if kind.is_compute and d.stream.text != COMPUTE:
                self.err(
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
                self.err(
                    "conflict",
                    f"overlap off keeps all-reduce on the compute stream, but "
                    f"this puts it on '{d.stream.text}'",
                    d.span,
                    hint="drop `overlap off`, or this line",
                )
                continue
            streams[kind] = d.stream.text
        return streams

    def programs(self, progs: list[Program], cfg, strategy, world, accum, streams):
        out = []
        known = {COMPUTE, COMM, *streams.values()}
        for p in progs:
            stream = p.stream.text
            if stream not in known:
                self.err(
                    "unknown-name",
                    f"unknown stream '{stream}'",
                    p.stream.span,
                    hint=did_you_mean(stream, known)
                    or "streams are compute, comm, and those named by `stream` lines",
                )
                continue
            rank = None
            if p.rank is not None:
                rank = int_of(self.diag, p.rank, "rank", 0, max(0, (world or 1) - 1))
                if rank is None:
                    continue
            key = f"program.{stream}.{rank}"
            if not self.once(
                key,
                p.span,
                f"the program of stream '{stream}'"
                + (f" on rank {rank}" if rank is not None else ""),
            ):
                continue
            instrs = []
            for ins in p.instrs:
                op = self.op(ins.op.text, ins.op.span, cfg, strategy, accum)
                afters = [
                    (self.op(a.text, a.span, cfg, strategy, accum), a.span) for a in ins.after
                ]
                if op is None or any(a is None for a, _ in afters):
                    continue
                if op.kind.is_compute and stream != COMPUTE:
                    self.err(
                        "compute-stream",
                        f"{op} is compute work, written on stream '{stream}'",
                        ins.op.span,
                        hint="write it in `program compute`",
                    )
                    continue
                instrs.append(
                    InstrSpec(
                        op, tuple(a for a, _ in afters), ins.span, tuple(s for _, s in afters)
                    )
                )
            out.append(ProgramSpec(stream, rank, tuple(instrs), p.span))
        return tuple(out)

    def op(self, text: str, span: Span, cfg, strategy, accum) -> Op | None:
        try:
            op = Op.parse(text)
        except OpSyntaxError as e:
            hint = did_you_mean(*e.suggest) if e.suggest else None
            self.err("syntax", str(e), span, hint=hint)
            return None
        if cfg is None or op.kind is Kind.STEP:
            return op
        if op.kind in (Kind.FWD, Kind.BWD, Kind.RECOMPUTE):
            targets, what = cfg.layers, "layer"
        elif op.kind is Kind.ALLREDUCE and isinstance(strategy, FSDPSpec) and self.replicated:
            targets, what = [u.name for u in strategy.units], "unit"  # HSDP's replicate step
        elif op.kind is Kind.ALLREDUCE:
            targets = [b.name for b in strategy.buckets] if isinstance(strategy, DDPSpec) else []
            what = "bucket"
        else:
            targets = [u.name for u in strategy.units] if isinstance(strategy, FSDPSpec) else []
            what = "unit"
        if not targets:
            self.err(
                "unexpected-op",
                f"{op} has no place in {Strategy.of(strategy).a_label} schedule",
                span,
                hint="DDP schedules all-reduce buckets; FSDP schedules gather, free "
                "and reduce-scatter units (and all-reduce them under a mesh R x S, R > 1)",
            )
            return None
        if op.target not in targets:
            self.err(
                "unknown-name",
                f"unknown {what} '{op.target}' in {op}",
                span,
                hint=(None if self.diag.full else did_you_mean(op.target, targets))
                or f"{what}s: {', '.join(targets)}",
            )
            return None
        if accum is not None and op.mb >= accum:
            self.err(
                "value-range",
                f"{op} names micro-step {op.mb}, but this schedule has mb0 .. mb{accum - 1}",
                span,
            )
            return None
        return op


FP32_TINY = 2.0**-126  # the smallest normal float32; below it values are subnormal, then 0


def _fp32(v: float) -> float:
    """`v` as the executor holds it: rounded to float32 (struct, so no numpy or torch here)."""
    return struct.unpack("f", struct.pack("f", v))[0]


# -- keyed settings: `model { n_layer = 4 }`, `optimizer adamw { lr = 3e-4 }`, `precision` ---

Reader = Callable[[Diagnostics, Field], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Keys:
    """The keys one `{ key = value ... }` block takes, each with the reader that checks its
    value and says what it sets (a key may set two: betas), or None after saying why not."""

    owner: str  # the block as its messages name it: "a model has no 'x'"
    scope: str  # where its keys are recorded in Spec.where: "model.n_layer"
    read: dict[str, Reader]  # in the order a hint lists them


@dataclass(frozen=True)
class Keyed:
    """What a block's fields set, and where each key was given."""

    values: dict[str, Any]
    spans: dict[str, Span]  # the field of each key read
    complete: bool  # every field with a known key was read: none repeated or refused


def _read_keyed(r: _Resolver, fields: tuple[Field, ...], keys: Keys) -> Keyed:
    """A block's fields read by its table: an unknown key is [unknown-setting] with the
    nearest key (or the list of them), a repeated one [duplicate], a value its reader's."""
    values: dict[str, Any] = {}
    spans: dict[str, Span] = {}
    complete = True
    for f in fields:
        key = f.key.text
        if key not in keys.read:
            r.err(
                "unknown-setting",
                f"{keys.owner} has no '{key}'",
                f.key.span,
                hint=did_you_mean(key, keys.read) or f"keys: {', '.join(keys.read)}",
            )
            continue
        got = None
        if r.once(f"{keys.scope}.{key}", f.key.span, f"'{key}'"):
            got = keys.read[key](r.diag, f)
        if got is None:
            complete = False
            continue
        values.update(got)
        spans[key] = f.span
    return Keyed(values, spans, complete)


def _dimension(attr: str, hi: int) -> Reader:
    """A model dimension: a whole number in [1, hi], GPTConfig's `attr`."""

    def read(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
        num = one_number(diag, f)
        n = None if num is None else int_of(diag, num, f.key.text, 1, hi)
        return None if n is None else {attr: n}

    return read


MODEL = Keys(
    "a model",
    "model",
    {
        "n_layer": _dimension("n_layer", 4096),
        "n_head": _dimension("n_head", 4096),
        "n_embd": _dimension("n_embd", 1 << 17),
        "block": _dimension("block_size", 1 << 20),
        "vocab": _dimension("vocab_size", 1 << 22),
    },
)


def _rate(*, positive: bool = False, flushed: str | None = None, zero: str = "") -> Reader:
    """A decimal in [0, 1e6) (> 0 if `positive`). Where a value that fp32, the precision AdamW
    runs in, holds as 0 or a subnormal (0 on a GPU) breaks training, `flushed` says how, and
    such a value is refused; `zero` says what 0 itself means where it is allowed."""

    def read(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
        key, num = f.key.text, one_number(diag, f)
        if num is None:
            return None
        v = num.value
        if not (0 <= v < 1e6) or (positive and v == 0):
            diag.error(
                "value-range",
                f"{key} = {num.text} is out of range",
                num.span,
                hint="lr must be > 0; rates, eps, clip and decay must be >= 0",
            )
            return None
        if flushed is not None and _fp32(v) < FP32_TINY and not (zero and v == 0):
            got = "0" if _fp32(v) == 0 else f"{_fp32(v):.3g}, a subnormal (0 on a GPU)"
            diag.error(
                "value-range",
                f"{key} = {num.text} is {got} in fp32, {flushed}",
                num.span,
                hint=f"write {key} >= {FP32_TINY:.3g} (fp32's smallest normal number)"
                + (f", or 0 {zero}" if zero else ""),
            )
            return None
        return {key: v}

    return read


def _steps(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """A number of optimizer steps: a whole number in [0, 2^30]."""
    num = one_number(diag, f)
    v = None if num is None else int_of(diag, num, f.key.text, 0, 1 << 30)
    return None if v is None else {f.key.text: v}


def _betas(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """`betas = 0.9, 0.95`: two numbers in [0, 1), kept when out of it (so OptimConfig says
    so too)."""
    nums = [v for v in f.values if isinstance(v, Num)]
    if len(nums) != 2 or len(f.values) != 2:
        diag.error("value-range", "betas takes two numbers: `betas = 0.9, 0.95`", f.span)
        return None
    betas = {"beta1": nums[0].value, "beta2": nums[1].value}
    if not all(0 <= b < 1 for b in betas.values()):
        diag.error("value-range", "betas must lie in [0, 1)", f.span)
    return betas


OPTIMIZER = Keys(
    "adamw",
    "optimizer",
    {
        "betas": _betas,
        # the gradient is scaled by clip / norm (0 itself means no clipping)
        "clip": _rate(
            flushed="so clipping would scale every gradient to zero",
            zero="to turn clipping off",
        ),
        "decay_steps": _steps,
        # AdamW divides m by sqrt(v) + eps, so eps is a divisor and 0 is refused too
        "eps": _rate(
            flushed="and AdamW divides by sqrt(v) + eps: a parameter that never gets a gradient "
            "(an unused embedding row) would become 0/0 = NaN",
        ),
        "lr": _rate(positive=True, flushed="so no update would change the model"),
        # weight_decay and min_lr that fp32 holds as 0 are plain zeros, which AdamW allows
        "min_lr": _rate(),
        "warmup": _steps,
        "weight_decay": _rate(),
    },
)


def _dtype(diag: Diagnostics, f: Field) -> dict[str, Any] | None:
    """One dtype by name (fp16 is read, then refused for what it needs: loss scaling)."""
    value = f.values[0] if len(f.values) == 1 else None
    text = value.text if isinstance(value, Name) else None
    if text not in {d.value for d in Dtype}:
        diag.error("value-range", f"{f.key.text} takes one dtype: fp32 or bf16", f.span)
        return None
    return {f.key.text: Dtype(text)}


PRECISION = Keys("precision", "precision", {"compute": _dtype, "gather": _dtype, "reduce": _dtype})


def _keyword(stmt) -> str:
    """The keyword a ddp or fsdp block statement begins with."""
    if isinstance(stmt, (Toggle, OtherSetting)):
        return stmt.key if isinstance(stmt, Toggle) else stmt.key.text
    return {
        BucketDecl: "bucket",
        BucketCap: "bucket_cap",
        UnitDecl: "unit",
        Prefetch: "prefetch",
        Recompute: "recompute",
    }[type(stmt)]


def _first(*values):
    return next(v for v in values if v is not None)


_UNSET = object()


def _range_hint(what: str, lo: int, hi: int) -> str | None:
    if what == "world":
        return "world is the number of data-parallel ranks"
    if what == "loss chunk":
        return "the number of tokens whose logits the head makes at once, e.g. `loss chunk 1024`"
    return None


def _mesh_hint(world: int) -> str:
    shapes = [f"{world // s} x {s}" for s in range(1, world + 1) if world % s == 0][:6]
    return f"replicate x shard must multiply to the world; for world {world}: {', '.join(shapes)}"


def _batch_hint(seqs: int, world: int) -> str:
    if seqs % world:
        return f"the global batch must be a multiple of world {world}"
    # the smallest micro sizes that divide seqs / world, found among divisors up to its root
    # (a scan of every size up to seqs would take minutes for a batch of 2**31)
    n = seqs // world
    small = [b for b in range(1, math.isqrt(n) + 1) if n % b == 0]
    divisors = sorted(set(small) | {n // b for b in small})[:4]
    return "for example " + ", ".join(f"micro {b} (k={n // b})" for b in divisors)


_MISSING_HINT = {
    "model": "add `model gpt2` (or gpt2-medium, mini, tiny, nano, ...)",
    "world": "add `world 8`: the number of data-parallel ranks",
    "batch": "add `batch 512 x 1024`: global sequences x tokens per sequence",
    "micro": "add `micro 16` (sequences per rank per micro-step) or `accumulate 4`",
}

"""The resolved schedule: what a .sched file declares, as plain frozen data.

`lang.resolve` builds a Spec from the AST; every later stage reads it. Nothing here
computes a schedule, only describes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

from schedc.ir.mesh import REPLICATE, SHARD, Mesh
from schedc.ir.op import COMM, COMPUTE, Kind, Op
from schedc.ir.pipeline import Pipeline, Placement, Programs, Schedule, Written
from schedc.ir.source import Source, Span
from schedc.model.arch import GPTConfig
from schedc.model.config import DataConfig, EvalConfig, OptimConfig

MiB = 1 << 20
TIED = "wte.weight"  # the embedding, tied to lm_head: written by bwd[head] and bwd[embed]


class Strategy(str, Enum):
    """How a schedule synchronizes gradients; `Spec.kind` is the one way to ask."""

    SINGLE = "single"  # one process: gradients added across micro-steps, no collectives
    DDP = "ddp"
    FSDP = "fsdp"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, strategy: DDPSpec | FSDPSpec | None) -> Strategy:
        if isinstance(strategy, DDPSpec):
            return cls.DDP
        return cls.FSDP if isinstance(strategy, FSDPSpec) else cls.SINGLE

    @property
    def label(self) -> str:
        return {"single": "single-process", "ddp": "DDP", "fsdp": "FSDP"}[self.value]

    @property
    def a_label(self) -> str:
        """The label after its article, as said aloud: "an FSDP" (eff-ess-dee-pee)."""
        return ("an " if self is Strategy.FSDP else "a ") + self.label


class Dtype(str, Enum):
    """A floating-point format a schedule computes or communicates in."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def nbytes(self) -> int:
        return 4 if self is Dtype.FP32 else 2


@dataclass(frozen=True)
class Numerics:
    """What a step computes and communicates in, in the terms of FSDP2's MixedPrecisionPolicy
    and DDP's communication hooks. Master weights, gradients held for the optimizer and the
    AdamW moments are fp32 always; only these are chosen.

    compute  the autocast dtype of forward and backward (fp32: no autocast)
    gather   the dtype FSDP units are all-gathered in (FSDP2's param_dtype; DDP gathers none)
    reduce   the dtype gradients are all-reduced or reduce-scattered in (reduce_dtype)
    tf32     fp32 matmuls on TF32 tensor cores; None: on where there are any (CUDA)
    compile  torch.compile each layer, or each run of layers that nothing separates
    loss_chunk  tokens per chunk of the head's fused logits + cross-entropy (`loss chunk N`,
             model/gpt2.py ChunkedLinearCE); None: the whole micro-batch's logits at once.
             Its weight gradient is a sum over chunks, not one matmul: another order of
             the same fp32 sum, and under bf16 each chunk's part rounded to bf16 on its own
    """

    compute: Dtype = Dtype.FP32
    gather: Dtype = Dtype.FP32
    reduce: Dtype = Dtype.FP32
    tf32: bool | None = None
    compile: bool = False
    loss_chunk: int | None = None

    def describe(self, kind: Strategy = Strategy.FSDP) -> str:
        """The policy in words; a dtype the strategy does not use is not claimed (DDP gathers
        nothing, one process reduces nothing)."""
        tf32 = "auto (on CUDA)" if self.tf32 is None else ("on" if self.tf32 else "off")
        dtypes = [f"compute {self.compute}"]
        if kind is Strategy.FSDP:
            dtypes.append(f"gather {self.gather}")
        if kind is not Strategy.SINGLE:
            dtypes.append(f"reduce {self.reduce}")
        loss = "" if self.loss_chunk is None else f"; loss in chunks of {self.loss_chunk:,} tokens"
        return (
            f"{', '.join(dtypes)}; master weights and AdamW fp32; tf32 {tf32}, compile "
            f"{'on' if self.compile else 'off'}{loss}"
        )

    def effective(self, kind: Strategy) -> Numerics:
        """The arithmetic a step really does under a strategy, for comparing two schedules.

        Without FSDP the layers compute with the fp32 master weights (gather fp32); one
        process reduces nothing (reduce fp32: its micro-steps add into fp32 gradients).
        tf32 unset is on: on CUDA that is what it means, and on a CPU tf32 does nothing.
        tf32 acts on fp32 matmuls only, and under bf16 autocast GPT-2 has none; compile
        changes where a value is rounded only below fp32 (a fused kernel keeps bf16
        intermediates in fp32), while in fp32 it reorders sums as much as a different world
        size does, which agreement already tolerates. A chunked loss likewise: in fp32 it
        reorders the weight gradient's sum, under bf16 it rounds each chunk's part on its own.
        """
        low = self.compute is not Dtype.FP32
        return Numerics(
            compute=self.compute,
            gather=self.gather if kind is Strategy.FSDP else Dtype.FP32,
            reduce=self.reduce if kind is not Strategy.SINGLE else Dtype.FP32,
            tf32=True if low or self.tf32 is None else self.tf32,
            compile=self.compile and low,
            loss_chunk=self.loss_chunk if low else None,
        )

    def differences(self, other: Numerics) -> list[str]:
        """What differs between two (effective) policies, as `key mine vs other`."""

        def word(v):
            if v is None:  # loss_chunk's: the whole micro-batch
                return "off"
            return ("on" if v else "off") if isinstance(v, bool) else str(v)

        return [
            f"{k.replace('_', ' ')} {word(getattr(self, k))} vs {word(getattr(other, k))}"
            for k in ("compute", "gather", "reduce", "tf32", "compile", "loss_chunk")
            if getattr(self, k) != getattr(other, k)
        ]


# the named policies of `precision NAME`; fields after the name override them
POLICIES = {
    "fp32": Numerics(),
    # what a GPT-2 user runs: bf16 autocast, bf16 weights gathered, fp32 gradient reduction
    # (torchtitan's default; FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    "bf16": Numerics(compute=Dtype.BF16, gather=Dtype.BF16, reduce=Dtype.FP32),
}


# -- the resolved schedule ----------------------------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    name: str
    params: tuple[str, ...]  # in gradient-ready order
    span: Span | None  # None for buckets made by bucket_cap
    nbytes: int


@dataclass(frozen=True)
class DDPSpec:
    buckets: tuple[BucketSpec, ...]  # in launch order
    overlap: bool = True
    no_sync: bool = True
    cap: int | None = None  # bucket_cap's bytes, when it made the buckets
    first: int | None = None  # and the first bucket's (`first`, default min(cap, 1 MiB))


@dataclass(frozen=True)
class UnitSpec:
    name: str
    params: tuple[str, ...]
    layers: tuple[str, ...]  # layers whose forward reads one of the unit's parameters
    keep: bool  # gathered once per step, freed at its end (the root)
    span: Span
    nbytes: int


@dataclass(frozen=True)
class FSDPSpec:
    units: tuple[UnitSpec, ...]  # in order of first use
    prefetch_forward: int = 1
    prefetch_backward: int = 1
    reshard_after_forward: bool = True
    no_sync: bool = False

    def unit_of(self, param: str) -> UnitSpec:
        for u in self.units:
            if param in u.params:
                return u
        raise KeyError(param)


@dataclass(frozen=True)
class InstrSpec:
    op: Op
    after: tuple[Op, ...]
    span: Span
    after_spans: tuple[Span, ...]


@dataclass(frozen=True)
class ProgramSpec:
    stream: str
    rank: int | None  # None: every rank
    instrs: tuple[InstrSpec, ...]
    span: Span


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage: a contiguous run of layers, in model order."""

    name: str
    layers: tuple[str, ...]
    span: Span


@dataclass(frozen=True)
class StageUnit:
    """An FSDP unit of a pipeline stage: parameters of one stage, sharded over its dp
    replicas, gathered once a step before the stage's first forward and kept until its last
    backward, its gradient then reduce-scattered."""

    name: str
    stage: int
    params: tuple[str, ...]
    span: Span  # the `unit` line, or the stage's (one unit a stage, by default)


@dataclass(frozen=True)
class StageBucket:
    """A DDP bucket of a pipeline stage: parameters of one stage, their gradients
    all-reduced over its dp replicas in one flat tensor after the stage's last backward."""

    name: str
    stage: int
    params: tuple[str, ...]  # in the model's order
    span: Span  # the `bucket` line, or the stage's (one bucket a stage, by default)


def stage_units(
    cfg: GPTConfig, split: tuple[tuple[str, ...], ...]
) -> list[tuple[int, tuple[str, ...]]]:
    """One FSDP unit a stage, as (stage, parameters), and the tied wte.weight one of its own
    on the embed's stage (the head's stage keeps a copy, sharded in the same layout so that
    the two copies' shards are the same slices)."""
    out: list[tuple[int, tuple[str, ...]]] = []
    for s, layers in enumerate(split):
        params = [p.name for layer in layers for p in cfg.layer_params(layer)]
        if TIED in params:
            out.append((s, (TIED,)))
            params.remove(TIED)
        if params:
            out.append((s, tuple(params)))
    return out


@dataclass(frozen=True)
class WrittenPrograms:
    """`program on rank N { ... }` in a pipeline block: every rank's items as written, and
    where each is in the file, so that a proof's finding points at the item it is about."""

    programs: Programs  # pipeline rank -> items in issue order
    items: dict[tuple[int, int], Span] = field(compare=False)  # (rank, item index) -> span
    heads: dict[int, Span] = field(compare=False)  # rank -> its `program` keyword


def rank_buckets(
    cfg: GPTConfig, buckets: tuple[tuple[str, ...], ...], held: set[str], tied_copy: bool
) -> list[list[str]]:
    """A pipeline rank's DDP buckets (a ddp block's, each inside a stage): each restricted to
    the parameters `held`, in reverse layer order (the order backward completes them). Where
    the rank holds the head's copy of the tied wte (`tied_copy`: the head's stage without the
    embed's, whose bucket holds the wte), the copy goes with the bucket holding the head's
    own parameters. The executor's and the memory ledger's one rule."""
    out = [[n for n in b if n in held and not (tied_copy and n == TIED)] for b in buckets]
    out = [b for b in out if b]
    if tied_copy:
        head = {p.name for p in cfg.layer_params("head")}
        next(b for b in out if head & set(b)).append(TIED)  # the buckets cover the head
    return sorted(out, key=lambda b: -max(cfg.layer_index(cfg.param(n).layer) for n in b))


@dataclass(frozen=True)
class PipelineSpec:
    """`pipeline { ... }`: stages over `degree` ranks, run by a named schedule or by
    programs written in the block (`schedule` is then Written.PROGRAMS).

    Ranks are laid out pp-outermost, as torchtitan's mesh ["pp", "dp_replicate", "dp_shard"]:
    rank = pp_index x dp + dp_index, so a stage's dp replicas are consecutive ranks (one
    node: their gradient collectives are the heavy traffic) and the stages sit dp ranks
    apart (the slower links carry only activations and their gradients). Global rank r runs
    pipeline rank r // dp's stages on replica r % dp's slice of the batch.
    """

    stages: tuple[StageSpec, ...]
    degree: int  # pipeline ranks
    schedule: Schedule | Written
    placement: Placement
    span: Span  # the `pipeline` keyword: where a finding about the whole block points
    where: dict[str, Span] = field(default_factory=dict, compare=False)  # setting -> span
    # FSDP per stage (an fsdp block): its units, every parameter once, each inside a stage;
    # empty: each stage's gradients are all-reduced over dp in one bucket (DDP)
    units: tuple[StageUnit, ...] = ()
    written: WrittenPrograms | None = None  # with Written.PROGRAMS: the programs
    # DDP per stage (a ddp block): its buckets, every parameter once, each inside a stage;
    # empty: one bucket a stage
    buckets: tuple[StageBucket, ...] = ()

    def pipeline(self, microbatches: int) -> Pipeline:
        return Pipeline(self.degree, len(self.stages), microbatches, self.placement)


@dataclass(frozen=True)
class Spec:
    """Everything a schedule declares, resolved and checked."""

    source: Source
    model_name: str
    model: GPTConfig
    world: int
    seqs: int  # global batch, sequences
    seq_len: int  # tokens per sequence
    micro: int  # sequences per rank per micro-step
    accum: int  # micro-steps per update (k)
    steps: int
    seed: int
    data: DataConfig
    optim: OptimConfig
    memory: int | None
    strategy: DDPSpec | FSDPSpec | None  # None: one process, no collectives
    streams: dict[Kind, str]
    programs: tuple[ProgramSpec, ...]
    numerics: Numerics = field(default_factory=Numerics)
    # layers whose forward keeps only its input and runs again right before their backward
    recompute: frozenset[str] = frozenset()
    evaluation: EvalConfig = field(default_factory=EvalConfig)  # measured, not trained
    where: dict[str, Span] = field(default_factory=dict, compare=False)
    # replicate x shard (in a pipeline file, of a stage's dp replicas: `stage_mesh`); None (no
    # `mesh` in the file): flat, the strategy's one dimension
    declared_mesh: Mesh | None = None
    pipeline: PipelineSpec | None = None  # pipeline stages; None: every rank runs every layer

    @property
    def dp(self) -> int:
        """The data-parallel ranks, which share the global batch: the world, over the
        pipeline degree (the ranks of one pipeline compute one micro-batch together)."""
        return self.world // self.pipeline.degree if self.pipeline else self.world

    @property
    def mesh(self) -> Mesh:
        """The world as replicate x shard: the declared mesh, or the flat one (DDP replicates
        over the world, FSDP shards over it, one process has a 1 x 1 world)."""
        if self.declared_mesh is not None:
            return self.declared_mesh
        if self.kind is Strategy.FSDP:
            return Mesh(1, self.world)
        return Mesh(self.world, 1)

    @property
    def stage_mesh(self) -> Mesh:
        """A pipeline stage's dp replicas as replicate x shard: the declared mesh (HSDP per
        stage: R x S = dp, rank = pp_index x dp + replicate_index x S + shard_index), else
        FSDP per stage shards over all dp replicas (1 x dp) and DDP replicates over them."""
        if self.declared_mesh is not None:
            return self.declared_mesh
        if self.pipeline is not None and self.pipeline.units:
            return Mesh(1, self.dp)
        return Mesh(self.dp, 1)

    @property
    def hsdp(self) -> bool:
        """FSDP units sharded within groups and replicated across them: each unit's gradient
        shard is all-reduced over the replicate dimension after its reduce-scatter."""
        return self.kind is Strategy.FSDP and self.mesh.replicate > 1

    def dim_of(self, op: Op) -> str:
        """The mesh dimension a collective runs over: gathers and reduce-scatters over the
        shard dimension, all-reduces (DDP's buckets, HSDP's unit shards) over the replicate."""
        return REPLICATE if op.kind is Kind.ALLREDUCE else SHARD

    def dims(self) -> tuple[str, ...]:
        """The mesh dimensions this schedule's collectives run over."""
        if self.kind is Strategy.DDP:
            return (REPLICATE,)
        if self.kind is Strategy.FSDP:
            return (SHARD, REPLICATE) if self.mesh.replicate > 1 else (SHARD,)
        return ()

    @property
    def tokens_per_step(self) -> int:
        return self.seqs * self.seq_len

    @property
    def kind(self) -> Strategy:
        return Strategy.of(self.strategy)

    @property
    def sync(self) -> Strategy:
        """How gradients are combined across data-parallel ranks: the strategy's kind, or a
        pipeline's (FSDP under its fsdp block, DDP with replicas, else none)."""
        if self.pipeline is None:
            return self.kind
        if self.pipeline.units:
            return Strategy.FSDP
        return Strategy.DDP if self.dp > 1 else Strategy.SINGLE

    @property
    def fsdp(self) -> FSDPSpec:
        """The FSDP strategy (its units, prefetch, resharding); only FSDP schedules have one."""
        if not isinstance(self.strategy, FSDPSpec):
            raise TypeError(f"{self.kind.a_label} schedule has no FSDP units")
        return self.strategy

    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        """DDP's buckets, in launch order (none without DDP)."""
        return self.strategy.buckets if isinstance(self.strategy, DDPSpec) else ()

    @property
    def no_sync(self) -> bool:
        return bool(self.strategy and self.strategy.no_sync)

    def communicates(self, mb: int) -> bool:
        """Whether micro-step `mb` reduces gradients (no_sync: only the last one does)."""
        return mb == self.accum - 1 or not self.no_sync

    def stream_names(self) -> list[str]:
        names = [COMPUTE, COMM] + sorted(set(self.streams.values()) - {COMPUTE, COMM})
        names += sorted({p.stream for p in self.programs} - set(names))
        return names

    def writers(self, params) -> frozenset[str]:
        """The layers whose backward writes these parameters' gradients."""
        return frozenset(w for p in params for w in self.model.writers(p))

    def loss_weight(self) -> Fraction:
        """Weight of one token's loss in the update: 1/(B T) per micro mean, x 1/k, x 1/D
        (D the data-parallel ranks)."""
        return Fraction(1, self.micro * self.seq_len) / self.accum / self.dp

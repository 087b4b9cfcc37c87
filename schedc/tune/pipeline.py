"""`schedc tune` over a pipeline schedule: degree, schedule, micro-batches and the stage split.

    search_pipeline(base, cost, budget) -> PipeResult      # every candidate, best first

The file fixes the model, world, global batch, data and optimizer; tune writes the
`pipeline` block anew for each candidate, and how a stage's replicas sync (`--strategy`: DDP,
one bucket a stage, and FSDP, one unit a stage) and the numerics (`--precision`; default the
file's):

    degree        every divisor p >= 2 of the world that leaves each stage a layer (dp = world / p)
    schedule      gpipe, 1f1b, zb-h1 (one stage a rank), interleaved-1f1b with v = 2 and 3
                  (placement loop), zb-v (2 stages a rank in a V)
    microbatches  every m dividing a replica's sequences (batch / dp), up to 8 x the degree
    split         `even` (the layers by count, the earlier stages one more) and `balanced`
                  (contiguous stages minimising the slowest stage's F + B at the cost
                  model's per-layer times: the head's projection and loss weigh several blocks)

Each candidate is schedule text that schedc.compiler judges: the schedule's micro-batch rule,
the proof, the memory per rank against the budget (the ledger's peak, passes/pipeline_memory.py);
a refused candidate is counted by its diagnostic code. The step of the rest is predicted with
the cost model (analysis/cost.py), on every rank of one replica:

    pipeline   passes/pipeline_sim.py over the proven programs, at per-stage costs: a layer's
               forward overhead + FLOPs / rate, its backward 2 x FLOPs / rate + the
               gradient bytes it writes / grad_bandwidth (`compute_time`; a zero-bubble
               schedule's I the FLOPs, W the FLOPs and the gradient bytes, each paying the
               op's overhead), summed over the stage's layers; a transfer latency + one
               micro-batch's activations / bandwidth
    dp         each stage's gradients over its dp replicas, one collective at a time on the
               rank's comm stream, each from its stage's last backward: DDP's all-reduce,
               FSDP's reduce-scatter (the file's own HSDP per stage: over a mesh's S
               ranks, then its shard all-reduced over R), and FSDP's all-gather of every
               unit before step 0's first forward, which delays the whole pipeline by the
               slowest rank's
    tied       the wte copies of the first and last stage all-reduced once both are done
    optimizer  AdamW over the rank's parameters (FSDP: its shards), once every rank is
               done (the global norm is one all-reduce)

The step is the slowest rank's. What this leaves out: FSDP's gathers overlapping compute, the
executor's host time per item (on a CPU, `bench/pipeline_bench.py` measures it), and any
transfer's contention with dp traffic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from schedc.analysis.cost import (
    CostModel,
    compute_time,
    layer_grad_bytes,
    optimizer_time,
    ring_factor,
)
from schedc.compiler import Compiled, compile_text
from schedc.ir.op import Kind
from schedc.ir.pipeline import Schedule
from schedc.ir.sizes import padded, stream_bytes
from schedc.ir.spec import TIED, Spec, Strategy
from schedc.lang.diagnostics import CompileError
from schedc.model.arch import GPTConfig
from schedc.passes.pipeline_sim import Costs, Timing, simulate
from schedc.tune.space import Base

SCHEDULES = (
    (Schedule.GPIPE, 1),
    (Schedule.ONE_F_ONE_B, 1),
    (Schedule.ZB_H1, 1),
    (Schedule.INTERLEAVED, 2),
    (Schedule.INTERLEAVED, 3),
    (Schedule.ZB_V, 2),
)
MAX_MICROBATCHES = 8  # a rank's worth: m up to 8 x the degree (Megatron runs m >= 4p or so)


@dataclass(frozen=True)
class PipeKnobs:
    """One candidate: the pipeline block tune writes."""

    degree: int
    schedule: Schedule
    v: int  # stages a rank
    microbatches: int
    split: tuple[tuple[str, ...], ...]  # stage -> its layers, embed .. head in order
    balance: str  # "even" | "balanced": how `split` was cut ("as written": the file's own)
    sync: str = "ddp"  # how a stage's replicas sync: "ddp" | "fsdp" (one unit a stage)
    precision: str | None = None  # None: the file's numerics

    def describe(self) -> str:
        """`1f1b pp4 m8 balanced [2+1+1+2] ddp` in a table's width."""
        v = f" v{self.v}" if self.v > 1 else ""
        sizes = "+".join(str(len(s)) for s in self.split)
        prec = f" {self.precision}" if self.precision else ""
        return (
            f"{self.schedule.value}{v} pp{self.degree} m{self.microbatches} {self.balance} "
            f"[{sizes}] {self.sync}{prec}"
        )

    def block(self) -> str:
        """What this candidate writes after the file's kept statements: its `pipeline` block,
        and its `precision` and `fsdp { }` where it chooses them."""
        lines = ["pipeline {"]
        for i, layers in enumerate(self.split):
            lines.append(f"  stage s{i} = {layer_refs(layers)}")
        lines += [
            f"  degree {self.degree}",
            f"  schedule {self.schedule.value}",
            *([f"  placement {self.schedule.placement.value}"] if self.v > 1 else []),
            f"  microbatches {self.microbatches}",
            "}",
        ]
        if self.precision:
            lines.insert(0, f"precision {self.precision}")
        if self.sync == "fsdp":
            lines.append("fsdp { }")
        return "\n".join(lines)


def layer_refs(layers: tuple[str, ...]) -> str:
    """A stage's layers as the language writes them: runs of blocks as `h.a .. h.b`."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(f"h.{run[0]}" if len(run) == 1 else f"h.{run[0]} .. h.{run[-1]}")
            run.clear()

    for name in layers:
        if name.startswith("h.") and (not run or int(name[2:]) == run[-1] + 1):
            run.append(int(name[2:]))
            continue
        flush()
        if name.startswith("h."):
            run.append(int(name[2:]))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


# -- the space ----------------------------------------------------------------------------------


def even_split(layers: tuple[str, ...], stages: int) -> tuple[tuple[str, ...], ...]:
    """`stages` contiguous ranges by count, the earlier stages one more where they do not
    divide (exec/pipeline_model.py split_layers, without torch)."""
    size, extra = divmod(len(layers), stages)
    out, at = [], 0
    for s in range(stages):
        n = size + (s < extra)
        out.append(layers[at : at + n])
        at += n
    return tuple(out)


def balanced_split(
    layers: tuple[str, ...], weights: dict[str, float], stages: int
) -> tuple[tuple[str, ...], ...]:
    """`stages` non-empty contiguous ranges minimising the heaviest range's weight (the
    linear partition problem, by dynamic programming over cut points; ties keep the
    earlier cut)."""
    n = len(layers)
    prefix = [0.0]
    for name in layers:
        prefix.append(prefix[-1] + weights[name])
    inf = float("inf")
    # best[k][i]: the least heaviest range cutting layers[:i] into k ranges; cut[k][i]: the last
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = worst, j
    out, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        out.append(layers[j:i])
        i = j
    return tuple(reversed(out))


def candidates(
    cfg: GPTConfig,
    world: int,
    seqs: int,
    weights: dict[str, float],
    precisions: tuple[str | None, ...] = (None,),
    strategies: tuple[str, ...] = ("ddp", "fsdp"),
) -> list[PipeKnobs]:
    """Every candidate, in a fixed order; two splits that cut the same are one, and a
    pipeline without replicas syncs nothing (one candidate, `ddp`)."""
    out: dict[PipeKnobs, None] = {}
    layers = cfg.layers
    for p in range(2, world + 1):
        if world % p or seqs % (world // p):
            continue
        per_replica = seqs // (world // p)
        syncs = strategies if world > p else strategies[:1]
        for schedule, v in SCHEDULES:
            stages = p * v
            if stages > len(layers):
                continue
            splits = {even_split(layers, stages): "even"}
            splits.setdefault(balanced_split(layers, weights, stages), "balanced")
            for m in range(1, min(per_replica, MAX_MICROBATCHES * p) + 1):
                if per_replica % m:
                    continue
                for split, balance in splits.items():
                    for sync in syncs:
                        for prec in precisions:
                            k = PipeKnobs(p, schedule, v, m, split, balance, sync, prec)
                            out.setdefault(k)
    return list(out)


# -- the prediction ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PipeCandidate:
    knobs: PipeKnobs
    compiled: Compiled
    step: float  # seconds
    bubble: dict[int, float]  # pipeline rank -> idle share of the pipeline part
    comm: float  # the slowest rank's dp and tied collectives, seconds (overlapped or not)
    peak: int  # the largest rank's predicted peak, bytes

    @property
    def spec(self) -> Spec:
        return self.compiled.spec

    @property
    def tokens_per_s(self) -> float:
        return self.spec.seqs * self.spec.seq_len / self.step if self.step else 0.0


def layer_times(
    spec: Spec, cost: CostModel, micro: int
) -> dict[str, tuple[float, float, float, float]]:
    """Each layer's (forward, backward, input half I, weight half W) seconds for one
    micro-batch of `micro` sequences: a split backward pays the per-op overhead twice."""
    rate = cost.rate(spec.numerics)
    out = {}
    for layer in spec.model.layers:
        f = spec.model.layer_fwd_flops(layer, micro * spec.seq_len, spec.seq_len)
        g = layer_grad_bytes(spec.model, layer, spec.numerics.compile)
        out[layer] = (
            compute_time(f, 0.0, rate, cost),
            compute_time(2 * f, g, rate, cost),
            compute_time(f, 0.0, rate, cost),
            compute_time(f, g, rate, cost),
        )
    return out


def stage_costs(spec: Spec, cost: CostModel, split) -> Costs:
    """The simulator's per-stage costs (seconds) and the P2P latency of one micro-batch."""
    times = layer_times(spec, cost, spec.micro)
    means: dict[tuple[Kind, int], float] = {}
    for s, layers in enumerate(split):
        for k, kind in enumerate((Kind.F, Kind.B, Kind.I, Kind.W)):
            means[(kind, s)] = sum(times[x][k] for x in layers)
    act = spec.micro * spec.seq_len * spec.model.n_embd * stream_bytes(spec)
    return Costs.measured(means, latency=cost.latency + act / cost.bandwidth)


def _collective(cost: CostModel, kind: Kind, ranks: int, nbytes: float) -> float:
    """A ring collective of `nbytes` over `ranks` (none over one rank)."""
    if ranks < 2:
        return 0.0
    lat, bw = cost.link_of(kind)
    return lat + ring_factor(kind, ranks) * nbytes / bw


def held(spec: Spec, split, pipeline) -> dict[int, int]:
    """Parameters each stage holds: its layers', and the last stage the tied wte's copy
    when the first stage is on another rank."""
    model = spec.model
    out = {s: sum(model.layer_numel(x) for x in layers) for s, layers in enumerate(split)}
    last = len(split) - 1
    if pipeline.rank_of(last) != pipeline.rank_of(0):
        out[last] += model.param(TIED).numel
    return out


def predict(c: Compiled, knobs: PipeKnobs, cost: CostModel) -> PipeCandidate:
    """The step of a compiled candidate (see the module's docstring)."""
    spec, plan = c.spec, c.pipeline
    assert plan is not None and spec.pipeline is not None
    timing = simulate(plan.graph, stage_costs(spec, cost, knobs.split))
    dp, fsdp, p = spec.dp, bool(spec.pipeline.units), plan.pipeline
    S = spec.stage_mesh.shard if fsdp else dp  # FSDP shards over S (dp, or a mesh's shard)
    numel = held(spec, knobs.split, p)
    red = spec.numerics.reduce.nbytes
    sync = Kind.REDUCESCATTER if fsdp else Kind.ALLREDUCE
    finish, comm = {}, {}
    for r, program in plan.programs.items():
        t, spent = 0.0, 0.0
        for s in reversed(p.stages_of(r)):  # their last backwards come in this order
            took = _collective(cost, sync, S, numel[s] * red) + _replicate(spec, cost, S, numel[s])
            t = max(t, _last_backward(timing, program, r, s)) + took
            spent += took
        finish[r], comm[r] = max(t, timing.ends[(r, len(program) - 1)]), spent
    last = p.rank_of(len(knobs.split) - 1)
    if last != 0:  # the tied wte: its two copies summed once both ranks are done
        tied = _collective(cost, Kind.ALLREDUCE, 2, spec.model.param(TIED).numel * red)
        finish[0] = finish[last] = max(finish[0], finish[last]) + tied
        comm[0], comm[last] = comm[0] + tied, comm[last] + tied
    kind = Strategy.FSDP if fsdp else Strategy.DDP
    opt = max(
        optimizer_time(
            kind,
            spec.optim.clip,
            sum(padded(numel[s], S) / S if fsdp else numel[s] for s in p.stages_of(r)),
            cost,
        )
        for r in plan.programs
    )
    gather = _gathers(spec, cost, numel, fsdp, p)
    step = gather + max(finish.values()) + cost.latency + opt
    peak = max(m.peak for m in plan.memory.values()) if plan.memory else 0
    return PipeCandidate(knobs, c, step, timing.bubble, gather + max(comm.values()), peak)


def _replicate(spec: Spec, cost: CostModel, S: int, numel: int) -> float:
    """HSDP per stage: a stage's gradient shards all-reduced over the replicate group after
    its reduce-scatter (nothing without a mesh of R > 1)."""
    m = spec.stage_mesh
    if not spec.pipeline or not spec.pipeline.units or m.replicate == 1:
        return 0.0
    red = spec.numerics.reduce.nbytes
    return _collective(cost, Kind.ALLREDUCE, m.replicate, padded(numel, S) / S * red)


def _gathers(spec: Spec, cost: CostModel, numel: dict[int, int], fsdp: bool, p) -> float:
    """FSDP per stage: the slowest pipeline rank's all-gathers before its first forward."""
    if not fsdp:
        return 0.0
    nbytes = spec.numerics.gather.nbytes
    return max(
        sum(
            _collective(cost, Kind.ALLGATHER, spec.stage_mesh.shard, numel[s] * nbytes)
            for s in p.stages_of(r)
        )
        for r in range(p.pp)
    )


def _last_backward(timing: Timing, program, rank: int, stage: int) -> float:
    """When the rank's last B or W of `stage` ends."""
    ends = [
        timing.ends[(rank, i)]
        for i, item in enumerate(program)
        if not item[0].kind.is_p2p and item[0].stage == stage and item[0].kind in (Kind.B, Kind.W)
    ]
    return max(ends, default=0.0)


# -- the search ---------------------------------------------------------------------------------


@dataclass
class PipeResult:
    ranked: list[PipeCandidate]  # every simulated candidate, fastest first
    considered: int
    refused: Counter = field(default_factory=Counter)  # diagnostic code -> candidates
    first_refusal: CompileError | None = None

    def counts(self) -> str:
        why = ", ".join(f"{n} [{code}]" for code, n in self.refused.most_common())
        return f"{self.considered} pipeline candidates considered, {len(self.ranked)} simulated" + (
            f", {sum(self.refused.values())} refused by the checker ({why})" if why else ""
        )


def own(base: Base, cost: CostModel, budget: str | None) -> PipeCandidate | None:
    """The file's own pipeline predicted the same way (None: it does not compile within the
    budget, or its programs are written rather than named)."""
    path = str(base.source.path)
    try:
        c = compile_text(base.unbudgeted_text() + (f"\nmemory {budget}\n" if budget else ""), path)
    except CompileError:
        return None
    pipe = c.spec.pipeline
    if pipe is None or not isinstance(pipe.schedule, Schedule) or c.pipeline is None:
        return None
    split = tuple(s.layers for s in pipe.stages)
    knobs = PipeKnobs(
        pipe.degree,
        pipe.schedule,
        len(split) // pipe.degree,
        c.pipeline.pipeline.microbatches,
        split,
        "as written",
        "fsdp" if pipe.units else "ddp",
    )
    return predict(c, knobs, cost)


def _spec(base: Base) -> Spec:
    """The model, world, batch and numerics the file fixes: resolved from its kept statements
    as a data-parallel file (whatever its own pipeline block gets wrong, tune writes anew),
    else from the file as written but for its `memory` (a batch that only a pipeline's dp
    divides), whose error, located in the user's file, is the one raised."""
    path = str(base.source.path)
    assert base.pipeline is not None
    try:
        dp_only = (
            base.kept_text(blank=True, extra=(base.pipeline,))
            + "\nmicro 1\nddp { bucket_cap 25 MiB }\n"
        )
        return compile_text(dp_only, path).spec
    except CompileError:
        return compile_text(base.unbudgeted_text(), path).spec


def search_pipeline(
    base: Base,
    cost: CostModel,
    budget: str | None,
    precisions: tuple[str | None, ...] = (None,),
    strategies: tuple[str, ...] = ("ddp", "fsdp"),
) -> PipeResult:
    """Every candidate compiled and predicted, fastest first (ties: the smaller peak)."""
    spec = _spec(base)
    weights = {x: t[0] + t[1] for x, t in layer_times(spec, cost, 1).items()}
    space = candidates(spec.model, spec.world, spec.seqs, weights, precisions, strategies)
    res = PipeResult([], len(space))
    for k in space:
        text = base.pipeline_text(k.block(), budget, precision=k.precision is None)
        try:
            c = compile_text(text, str(base.source.path))
        except CompileError as e:
            res.refused.update(d.code for d in e.diagnostics)
            res.first_refusal = res.first_refusal or e
            continue
        res.ranked.append(predict(c, k, cost))
    res.ranked.sort(key=lambda c: (c.step, c.peak))
    return res

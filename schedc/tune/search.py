"""The search: Knobs -> compiled, checked, simulated candidates, best first, pruned by bounds.

    search(base, options) -> Result

1. Enumerate the space (tune/space.py) and give every candidate two bounds computed from
   the model's arithmetic alone, without compiling it:
     memory  a lower bound on its predicted peak (activations included)
     time    a lower bound on its simulated step (below)
2. Drop candidates whose memory bound exceeds the budget (never compiled).
3. Visit the rest in order of their time bound. The result is the best N families (a
   family: every knob but the FSDP unit partition, so rows differ in more than where the
   units are cut; each row is its family's best partition). Once the bound passes the
   N-th best family's predicted step, no later candidate can enter the top N: stop (a
   bound equal to it is visited: ties go to the smaller peak).
4. Compile each visited candidate through schedc.compiler (the checker's refusals are
   counted by diagnostic code), drop those whose predicted peak (activations included) exceeds the
   budget, drop a plan already simulated, and simulate the rest (analysis/simulate.py).

The time bound holds for the simulator by construction (analysis/simulate.py, analysis/cost.py): one
compute stream runs every fwd and bwd op of every micro-step and then the optimizer, so
    step >= compute + head + tail + optimizer
where head is what must be communicated before the first forward can start (FSDP: the
gathers of the tied unit and of the first unit) and tail what must be communicated after
the last backward (the all-reduce of the bucket holding the tied weight; FSDP: the
reduce-scatters of the tied and the first unit); and one comm stream runs every collective
one at a time, so
    step >= sum of the collectives + optimizer
counting only collectives that must happen (a unit gathered at least once per micro-step
unless kept, reductions once per micro-step unless no_sync).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from schedc.analysis.cost import CostModel, compute_time, optimizer_time, ring_factor
from schedc.analysis.overlap import overlap
from schedc.analysis.simulate import simulate
from schedc.compiler import Compiled, compile_text
from schedc.ir.op import Kind
from schedc.ir.sizes import batches_bytes, layer_acts, padded
from schedc.ir.spec import POLICIES, TIED, Numerics, Spec, Strategy
from schedc.lang.diagnostics import CompileError
from schedc.lang.params import auto_buckets
from schedc.model.arch import FP32
from schedc.tune.space import Base, Knobs, candidates, kept_policy

PROGRESS_S = 2.0  # how often a long search says how far it is


class Every:
    """`say` a line at most every PROGRESS_S seconds (a long loop's progress); the line is
    made only when said."""

    def __init__(self, say: Callable[[str], None] | None):
        self.say, self.last = say, time.perf_counter()

    def __call__(self, line: Callable[[], str]) -> None:
        if self.say is not None and time.perf_counter() - self.last > PROGRESS_S:
            self.last = time.perf_counter()
            self.say(line())


@dataclass(frozen=True)
class Options:
    budget: int | None = None  # bytes per rank, predicted peak + activation estimate
    budget_text: str | None = None  # as the user wrote it, for the written schedule
    cost: CostModel = field(default_factory=CostModel)
    top: int = 5
    precisions: tuple[str | None, ...] = (None,)  # None: the file's numerics
    strategies: tuple[str, ...] = ("ddp", "fsdp")


@dataclass
class Candidate:
    knobs: Knobs
    text: str  # the schedule, positions of the file's lines kept (see Base.text)
    lb_time: float
    lb_memory: int
    compiled: Compiled | None = None  # set by `evaluate`
    step: float = 0.0  # predicted seconds
    peak: int = 0  # predicted peak per rank (schedc check's total) ...
    activations: int = 0  # the activations' share of the peak (shown, not added)
    comm: float = 0.0
    exposed: float = 0.0

    @property
    def checked(self) -> Compiled:
        """The candidate compiled and checked: read only once `evaluate` has compiled it."""
        if self.compiled is None:
            raise RuntimeError(f"{self.knobs.describe()} is read before it was compiled")
        return self.compiled

    @property
    def spec(self) -> Spec:
        return self.checked.spec

    @property
    def tokens_per_s(self) -> float:
        return self.spec.tokens_per_step / self.step if self.step else 0.0


@dataclass
class Result:
    ranked: list[Candidate]  # the best `top`, fastest first
    considered: int = 0
    pruned_memory: int = 0  # memory bound over the budget: never compiled
    pruned_time: int = 0  # time bound past the N-th best: never compiled
    refused: Counter = field(default_factory=Counter)  # the checker's codes
    over_budget: int = 0  # compiled, predicted peak over the budget
    duplicates: int = 0  # compiled to a plan already simulated
    simulated: int = 0
    seconds: float = 0.0
    smallest_peak: Candidate | None = None  # when nothing fits: the least memory found
    first_refusal: CompileError | None = None  # what the checker said first, if anything
    other_numerics: Counter = field(default_factory=Counter)  # strategy -> candidates left out
    numerics: str = ""  # the file's numerics, in words

    @property
    def compiled(self) -> int:
        return sum(self.refused.values()) + self.over_budget + self.duplicates + self.simulated

    def counts(self) -> str:
        refused = ", ".join(f"{n} [{c}]" for c, n in sorted(self.refused.items())) or "0"
        other = "".join(
            f"{n:,} {s} that cannot keep the file's numerics, "
            for s, n in sorted(self.other_numerics.items())
        )
        return (
            f"{self.considered:,} considered: {other}"
            f"{self.pruned_memory:,} over the budget by bound, "
            f"{self.pruned_time:,} pruned by the time bound, {self.compiled:,} compiled "
            f"({refused} refused by the checker, {self.over_budget:,} over the budget, "
            f"{self.duplicates:,} duplicate plans, {self.simulated:,} simulated) "
            f"in {self.seconds:.1f} s"
        )


class Probe:
    """What the bounds need of the fixed part: the model and numerics of one compiled
    candidate (every candidate shares them), and per-micro-size compute times, cached."""

    def __init__(self, base: Base, first: Knobs, options: Options):
        self.base, self.cost = base, options.cost
        c = compile_text(base.text(first, None, None), base.source.path, prove=False)
        self.spec = c.spec
        self._compute: dict[tuple[int, str | None], float] = {}

    def numerics(self, k: Knobs) -> Numerics:
        if k.policy is not None:
            return k.policy
        if k.precision is None:
            return self.spec.numerics
        n = self.spec.numerics
        return replace(POLICIES[k.precision], tf32=n.tf32, compile=n.compile)

    def spec_for(self, k: Knobs) -> Spec:
        s = self.spec
        return replace(
            s,
            micro=k.micro,
            accum=s.seqs // (k.micro * s.world),
            numerics=self.numerics(k),
            strategy=None,
        )

    def compute(self, k: Knobs) -> float:
        """Every fwd and bwd of one step on the compute stream, seconds."""
        key = (k.micro, k.precision)
        if key not in self._compute:
            s = self.spec_for(k)
            cfg, tokens = s.model, k.micro * s.seq_len
            rate, c = self.cost.rate(s.numerics), self.cost
            # per layer a forward and a backward, each as the cost model prices it
            per = sum(
                compute_time(cfg.layer_fwd_flops(x, tokens, s.seq_len), 0.0, rate, c)
                + compute_time(2 * cfg.layer_fwd_flops(x, tokens, s.seq_len), g, rate, c)
                for x in cfg.layers
                for g in [cfg.layer_bytes(x)]
            )
            self._compute[key] = s.accum * per
        return self._compute[key]

    def collective(self, kind: Kind, nbytes: float) -> float:
        latency, bandwidth = self.cost.link_of(kind)
        return latency + ring_factor(kind, self.spec.world) * nbytes / bandwidth

    def bounds(self, k: Knobs) -> tuple[float, int]:
        s = self.spec_for(k)
        cfg, D, num = s.model, s.world, s.numerics
        # activations: at the end of any micro-step's forward every layer's saved tensors
        # and the step's token batches are live beside the states (tune searches no
        # recomputation), so they bound the peak from below
        acts = batches_bytes(s) + sum(layer_acts(s, x).saved for x in cfg.layers)
        compute, c = self.compute(k), self.cost
        if k.strategy != "fsdp":
            opt = optimizer_time(Strategy.DDP, s.optim.clip, cfg.numel, c)
            memory = 4 * FP32 * cfg.numel + acts
            if k.strategy == "single":
                return compute + opt, memory
            r = num.reduce.nbytes
            buckets = self.buckets(k)
            n_reduce = 1 if k.no_sync else s.accum
            last = next(n for n, params in buckets if TIED in params)
            tail = self.collective(Kind.ALLREDUCE, last * r)
            comm = n_reduce * sum(self.collective(Kind.ALLREDUCE, n * r) for n, _ in buckets)
            return max(compute + tail, comm) + opt, memory
        g, r = num.gather.nbytes, num.reduce.nbytes
        units = self.units(k)  # padded numel, tied first, then u1 ...
        opt = optimizer_time(Strategy.FSDP, s.optim.clip, sum(units) / D, c)
        ag = lambda n: self.collective(Kind.ALLGATHER, n * g)
        rs = lambda n: self.collective(Kind.REDUCESCATTER, n * r)
        head = ag(units[0]) + ag(units[1])
        tail = rs(units[0]) + rs(units[1])
        n_reduce = 1 if k.no_sync else s.accum
        gathers = sum(ag(n) * (1 if i == 0 or k.keep_all else s.accum) for i, n in enumerate(units))
        comm = gathers + n_reduce * sum(rs(n) for n in units)
        # between steps: parameter shards and Adam m, v. The tied unit stays gathered all
        # step, and its unsharded gradient is live from bwd[head] (the first backward of a
        # micro-step) to its reduce-scatter after bwd[embed] (the last): so both are live
        # when any other unit's first backward writes that unit's gradient, which needs
        # that unit gathered (with every unit kept: all of them gathered)
        held = 3 * FP32 * sum(n // D for n in units)
        largest = max(units[1:])
        gathered = units[0] + (sum(units[1:]) if k.keep_all else largest)
        live = (gathered + units[0] + largest) * g
        if r != g:  # the tied reduce-scatter's input, cast to the reduce dtype, beside both
            live = max(live, 2 * units[0] * g + units[0] * r)
        # two moments, each a lower bound: a backward (above, activations left out) and the
        # end of a forward (the tied unit gathered beside every layer's saved activations)
        return max(compute + head + tail, comm) + opt, held + max(live, units[0] * g + acts)

    def buckets(self, k: Knobs) -> list[tuple[int, frozenset[str]]]:
        """(numel, params) per bucket, as the compiler will make them."""
        cfg = self.spec.model
        groups: list[Sequence[str]]
        if k.layout == "cap":
            made = auto_buckets(cfg, k.cap, min(k.cap, 1 << 20))
            groups = [b.params for b in made]
        elif k.layout == "one":
            groups = [[p.name for p in cfg.params]]
        else:
            groups = [[p.name for p in cfg.layer_params(x)] for x in cfg.layers]
        return [(sum(cfg.param(p).numel for p in ps), frozenset(ps)) for ps in groups if ps]

    def units(self, k: Knobs) -> list[int]:
        cfg, D = self.spec.model, self.spec.world
        sizes = [padded(cfg.param(TIED).numel, D)]
        last = len(k.groups) - 1
        for i, (a, b) in enumerate(k.groups):
            n = sum(cfg.layer_numel(f"h.{j}") for j in range(a, b + 1))
            n += cfg.param("wpe.weight").numel if i == 0 else 0
            n += cfg.layer_numel("head") if i == last else 0
            sizes.append(padded(n, D))
        return sizes


def search(
    base: Base, options: Options = Options(), progress: Callable[[str], None] | None = None
) -> Result:
    """The fastest candidates that fit (`options`); `progress` hears how far the search is,
    a line every PROGRESS_S seconds."""
    t0 = time.perf_counter()
    tick = Every(progress)
    # any legal candidate shares the model, batch and the file's numerics: micro 1 always
    # divides the batch (if anything does), and one bucket needs no layer names
    first = Knobs("ddp", 1, layout="one") if base.world > 1 else Knobs("single", 1)
    probe = Probe(base, first, options)
    spec = probe.spec
    res = Result([])
    scored = bounded(base, probe, options, res)
    budget = options.budget
    # the best candidate of each family (the knobs but the FSDP unit partition): the table
    # lists families, so its rows differ in more than where the units are cut
    best: dict[Knobs, tuple[float, int, int, Candidate]] = {}
    seen_plans: set = set()
    least: Candidate | None = None  # the least predicted peak, for "nothing fits"
    fits = [x for x in scored if budget is None or x[3] <= budget]
    res.pruned_memory = len(scored) - len(fits)
    for n, (lb_t, i, k, lb_m) in enumerate(fits):
        if len(best) >= options.top and lb_t > sorted(best.values())[options.top - 1][0]:
            # nothing from here on can enter the top N: a new family would need to beat the
            # N-th best, and a family already there its own best, which is no slower (a
            # bound equal to it may still tie it with a smaller peak: visited)
            res.pruned_time += len(fits) - n
            break
        if family(k) in best and lb_t > best[family(k)][0]:
            res.pruned_time += 1  # cannot beat its own family's best partition
            continue
        tick(partial(_progress, n, len(fits), res, len(best), t0))
        cand = Candidate(k, base.text(k, spec.model, options.budget_text), lb_t, lb_m)
        if not evaluate(cand, base, options, res, seen_plans):
            continue
        if least is None or cand.peak < least.peak:
            least = cand
        if budget is not None and cand.peak > budget:
            res.over_budget += 1
            continue
        res.simulated += 1
        # ties: the smaller peak (five at 96 ms went to micro 64 at 64 GiB over micro 16 at
        # 17 GiB), then enumeration order
        entry = (round(cand.step, 12), cand.peak, i, cand)
        if family(k) not in best or entry[:3] < best[family(k)][:3]:
            best[family(k)] = entry
    if not best and budget is not None:
        res.smallest_peak = smallest_peak(base, options, scored, spec.model, least)
    res.ranked = proved([c for *_, c in sorted(best.values(), key=lambda x: x[:3])[: options.top]])
    res.seconds = time.perf_counter() - t0
    return res


def bounded(base: Base, probe: Probe, options: Options, res: Result) -> list:
    """The space that keeps the file's numerics (or searches --precision), each candidate
    with its lower bounds, (time, place, knobs, memory), fastest bound first."""
    spec = probe.spec
    space = candidates(
        spec.model.n_layer, spec.seqs, spec.world, options.precisions, options.strategies
    )
    res.considered = len(space)
    space = keep_numerics(space, spec.numerics, base.kind, res)
    res.numerics = spec.numerics.describe(base.kind)
    scored = []
    for i, k in enumerate(space):
        lb_t, lb_m = probe.bounds(k)
        # to the picosecond: k x (one micro-step) rounds differently for each micro size,
        # and equal bounds should go in enumeration order (larger micro-steps first)
        scored.append((round(lb_t, 12), i, k, lb_m))
    return sorted(scored, key=lambda x: (x[0], x[1]))


def _progress(n: int, total: int, res: Result, ranked: int, t0: float) -> str:
    return (
        f"{n:,} of {total:,} candidates by bound, {res.compiled:,} compiled, {ranked} ranked "
        f"({time.perf_counter() - t0:.0f} s)"
    )


def keep_numerics(
    space: list[Knobs], declared: Numerics, file: Strategy, res: Result
) -> list[Knobs]:
    """The candidates that keep the file's numerics (those not searching a --precision), each
    declaring them as its strategy needs (tune/space.py `kept_policy`); those whose strategy
    cannot compute them are counted in `res.other_numerics`, not searched."""
    policies = {s: kept_policy(declared, file, Strategy(s)) for s in ("single", "ddp", "fsdp")}
    kept = []
    for k in space:
        if k.precision is not None:
            kept.append(k)
        elif (policy := policies[k.strategy]) is None:
            res.other_numerics[k.strategy] += 1
        else:
            kept.append(k if policy == declared else replace(k, policy=policy))
    return kept


def fastest_absent(base: Base, options: Options, res: Result) -> dict[str, Candidate | None]:
    """The fastest candidate of each searched strategy without a row in `res.ranked` (a DDP
    file at world 8 ranked five FSDP families and no DDP one, and the user never saw what
    DDP would give): the same search, limited to that strategy and one row. None: nothing
    of that strategy fits. At world 1 there is one strategy: nothing to add."""
    if base.world == 1 or not res.ranked:
        return {}
    shown = {c.knobs.strategy for c in res.ranked}
    return {
        s: next(iter(search(base, replace(options, strategies=(s,), top=1)).ranked), None)
        for s in options.strategies
        if s not in shown
    }


def proved(ranked: list[Candidate]) -> list[Candidate]:
    """What tune writes, compiled again with its proof (docs/proof.md)."""
    for cand in ranked:
        assert cand.compiled is not None
        cand.compiled = compile_text(cand.text, cand.compiled.source.path)
    return ranked


def family(k: Knobs) -> Knobs:
    """What a table row stands for: the knobs but the unit partition (its best one)."""
    return replace(k, groups=())


def evaluate(
    cand: Candidate, base: Base, options: Options, res: Result, seen: set, timed: bool = True
) -> bool:
    """Compile, check and (`timed`) simulate one candidate; False when the checker refused
    it or its plan was seen already (counted in `res`). Without the proof: the ranking does
    not need it, and the candidates tune writes are compiled again with it."""
    try:
        c = compile_text(cand.text, base.source.path, prove=False)
    except CompileError as e:
        errors = [d for d in e.diagnostics if d.is_error] or e.diagnostics
        res.refused[errors[0].code if errors else "error"] += 1
        res.first_refusal = res.first_refusal or e
        return False
    cand.compiled = c
    cand.peak, cand.activations = c.memory.peak, c.memory.activations
    key = (tuple(c.plan().instrs), c.memory.peak, c.spec.numerics, c.spec.micro)
    if key in seen:
        res.duplicates += 1
        return False
    seen.add(key)
    if not timed:
        return True
    tl = simulate(c, options.cost)
    ov = overlap(tl)[tl.ranks[0]]
    cand.step, cand.comm, cand.exposed = tl.end, ov.comm, ov.exposed
    return True


def smallest_peak(base: Base, options: Options, scored, cfg, least=None) -> Candidate | None:
    """When nothing fits: compile in order of the memory bound until the
    bound passes the least predicted peak found (the bound is a lower bound, so this finds
    the true least); `least`: the least found so far, where the search compiled some."""
    quiet = Options(None, None, options.cost, options.top, options.precisions)
    for _, _, k, lb_m in sorted(scored, key=lambda x: (x[3], x[1])):
        if least is not None and lb_m >= least.peak:
            break
        cand = Candidate(k, base.text(k, cfg, None), 0.0, lb_m)
        spare = Result([])
        if evaluate(cand, base, quiet, spare, set(), timed=False):
            if least is None or cand.peak < least.peak:
                least = cand
    return least

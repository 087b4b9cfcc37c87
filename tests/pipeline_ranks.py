"""The pipeline executor's test cases, run on the pool's ranks (tests/pool.py `Call`) and,
for comparison, by the single-process reference.

    pool.call("tests.pipeline_ranks:run_case", case.world, case)  -> every rank's StepStats
    reference(case)                                              -> the oracle's StepResults
    merged(per_rank)                                             -> one result for the oracle
    merged(replicas(per_rank, case))         -> the same, the replicas first shown bitwise equal
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from schedc.model.arch import SIZES, GPTConfig
from schedc.model.config import DataConfig, OptimConfig
from schedc.passes.pipeline_gen import Request, Schedule

# the world-1 schedule `schedc check` says makes the same update as the bundled tiny pipelines
# (tiny_pp2_interleaved, tiny_pp2_dp2): the same model, seed, 8 sequences and optimizer
ONE_PROCESS = """\
model tiny
world 1
batch 8 x 64
micro 2
steps 40
seed 1337
data corpus
optimizer adamw { lr = 3e-3  min_lr = 3e-4  warmup = 5 }
"""


@dataclass(frozen=True)
class Case:
    """A named schedule on `pp` ranks over `m` micro-batches of `micro` sequences."""

    schedule: Schedule
    pp: int
    m: int
    v: int = 1
    steps: int = 2
    n_layer: int = 6  # nano's width, 8 layers: embed, h.0 .. h.5, head (8 stages at most)
    micro: int = 1
    seq_len: int = 32
    seed: int = 7
    lr: float = 1e-3
    clip: float = 1.0
    sizes: tuple[int, ...] | None = None  # layers a stage, in order; None: split_layers
    dtype: str = "float32"
    dp: int = 1  # replicas of the pipeline: world pp x dp, pp-outermost
    fsdp: bool = False  # each stage's parameters sharded over dp (one unit a stage)
    precision: tuple[str, str, str] = ("fp32", "fp32", "fp32")  # compute, gather, reduce
    buckets: int = 1  # DDP buckets a stage (a ddp block's, layers cut evenly); 1: the default
    replicate: int = 1  # HSDP per stage (fsdp): the dp replicas as mesh R x dp / R; 1: no mesh
    # a wrong binding: every dp reduction's divisor bound as this (0: as bound); the proof
    # refutes it, and the executor runs it, since it runs what its bound plan says
    divisor: int = 0
    # a wrong plan bound into every rank's plan as if no proof had looked ("": as bound):
    # a class of tests/plan_mutations.py (its first variant) or "perturb LABEL"
    mutation: str = ""

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def __str__(self) -> str:
        v = f"-v{self.v}" if self.v > 1 else ""
        cut = "-" + ".".join(map(str, self.sizes)) if self.sizes else ""
        dtype = "" if self.dtype == "float32" else f"-{self.dtype}"
        dp = f"-{'fsdp' if self.fsdp else 'dp'}{self.dp}" if self.dp > 1 or self.fsdp else ""
        low = "-" + "-".join(self.precision) if self.low else ""
        dp += f"-b{self.buckets}" if self.buckets > 1 else ""
        dp += f"-r{self.replicate}" if self.replicate > 1 else ""
        return (
            f"{self.schedule.value}{v}-pp{self.pp}{dp}-m{self.m}{cut}-{self.steps}steps{dtype}{low}"
        )

    @property
    def low(self) -> bool:
        return self.precision != ("fp32", "fp32", "fp32")

    @property
    def tolerance(self) -> str:
        """The TOL key the case is held to (tests/oracle.py policy_key)."""
        from schedc.ir.spec import Dtype, Numerics
        from tests.oracle import policy_key

        compute, gather, reduce = (Dtype(d) for d in self.precision)
        num = Numerics(compute, gather if self.fsdp else Dtype.FP32, reduce)
        return policy_key(num, self.dp, self.dtype)

    def torch_dtypes(self) -> dict:
        """PipeJob's compute, gather and reduce (None: the run's dtype)."""
        import torch

        low = {"fp32": None, "bf16": torch.bfloat16}
        compute, gather, reduce = (low[d] for d in self.precision)
        return {"compute": compute, "gather": gather if self.fsdp else None, "reduce": reduce}

    def split(self, stages: int) -> tuple[tuple[str, ...], ...]:
        from schedc.exec.pipeline_model import split_layers

        if self.sizes is None:
            return split_layers(self.config, stages)
        layers, out = self.config.layers, []
        for n in self.sizes:
            out.append(tuple(layers[len(sum(out, ())) :][:n]))
        return tuple(out)

    @property
    def config(self) -> GPTConfig:
        return SIZES["nano"].with_overrides(n_layer=self.n_layer)

    @property
    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, warmup=1, clip=self.clip)

    @property
    def mesh(self):
        """HSDP per stage: the dp replicas as replicate x shard; None: no mesh."""
        from schedc.ir.spec import Mesh

        return Mesh(self.replicate, self.dp // self.replicate) if self.replicate > 1 else None

    @property
    def request(self) -> Request:
        return Request(self.schedule, self.pp, self.m, self.v)

    def text(self) -> str:
        """The case as a pipeline file: what `schedc check` proves and binds (its run's dtype
        and precision are the executor's; the file says the schedule)."""
        cfg = self.config
        split = self.split(self.pp * self.v)
        stages = "\n".join(f"  stage s{i} = {', '.join(layers)}" for i, layers in enumerate(split))
        mesh = (
            f"mesh {self.replicate} x {self.dp // self.replicate}\n" if self.replicate > 1 else ""
        )
        sync = "fsdp { }\n" if self.fsdp else ""
        if self.buckets > 1:
            owner = {p.name: layer for layer in cfg.layers for p in cfg.layer_params(layer)}
            lines = [
                f"  bucket b{i} = {', '.join(dict.fromkeys(owner[q] for q in params))}"
                for i, params in enumerate(stage_buckets(cfg, split, self.buckets))
            ]
            sync = "ddp {\n" + "\n".join(lines) + "\n}\n"
        return (
            f"model nano {{ n_layer = {self.n_layer} }}\nworld {self.world}\n{mesh}"
            f"batch {self.m * self.micro * self.dp} x {self.seq_len}\nsteps {self.steps}\n"
            f"seed {self.seed}\n"
            f"pipeline {{\n{stages}\n  degree {self.pp}\n  schedule {self.schedule.value}\n"
            f"  placement {self.schedule.placement.value}\n  microbatches {self.m}\n}}\n{sync}"
        )

    def bound(self, rank: int):
        """Global `rank`'s bound plan of the case's file (passes/pipeline_bind.py): the
        operands `schedc run` hands its executor."""
        from schedc.compiler import compile_text
        from schedc.passes.pipeline_bind import bind_rank

        if self.mutation:
            return _mutated(self)[rank]
        c = compile_text(self.text(), f"<{self}>", prove=False)
        assert c.pipeline is not None, self.text()
        bound = bind_rank(c.spec, c.pipeline.pipeline, c.pipeline.programs, rank)
        if not self.divisor:
            return bound
        instrs = tuple(
            replace(i, divisor=self.divisor) if i.divisor > 1 else i for i in bound.plan.instrs
        )
        return replace(bound, plan=replace(bound.plan, instrs=instrs))


@lru_cache(maxsize=4)
def _mutated(case: Case) -> list:
    """Every rank's bound plan of the case with its mutation's first variant in them."""
    from schedc.compiler import compile_text
    from tests.operand_perturbations import variant

    c = compile_text(replace(case, mutation="").text(), f"<{case}>", prove=False)
    return variant(c.spec, [c.bound(r) for r in range(c.spec.world)], case.mutation)


@lru_cache(maxsize=8)
def batches(seq_len: int, seqs: int, vocab: int):
    from schedc.model.data import load_batches

    return load_batches(DataConfig(), seq_len, seqs, vocab)


def run_case(rank: int, groups, case: Case) -> list:
    """This rank's steps of the case (StepStats with its own gradients and parameters)."""
    import torch

    from schedc.exec.pipeline import PipelineExecutor
    from schedc.exec.pipeline_model import PipeJob
    from schedc.passes.pipeline_gen import generate

    gen = generate(case.request)
    cfg = case.config
    data = batches(case.seq_len, case.m * case.micro * case.dp, cfg.vocab_size)
    split = case.split(gen.pipeline.stages)
    dtype = getattr(torch, case.dtype)
    job = PipeJob(cfg, split, data, case.optim, case.steps, case.seed, dtype, **case.torch_dtypes())
    comm = pool_comm(rank, groups, gen.pipeline, case.world, case.dp, case.mesh)
    ex = PipelineExecutor(job, gen.pipeline, comm, case.bound(rank), record=True)
    return steps_as_bound(ex, case.steps)


def steps_as_bound(ex, steps: int) -> list:
    """`steps` steps of the executor, each shown to have run its bound plan: every stage op
    and collective, with its group's global ranks and its divisor, in the plan's order (the
    plan the proof read is the plan that ran)."""
    want = [(str(i.op), i.group, i.divisor) for i in ex.bound.plan.instrs if i.op is not None]
    out = []
    for _ in range(steps):
        out.append(ex.step())
        ran = [(str(op), group, divisor) for op, group, divisor in ex.sync.ran]
        assert ran == want, _first_difference(ex.rank, ran, want)
    return out


def _first_difference(rank: int, ran: list, want: list) -> str:
    k = next((k for k, (a, b) in enumerate(zip(ran, want)) if a != b), min(len(ran), len(want)))
    return (
        f"rank {rank} ran {ran[k] if k < len(ran) else 'nothing more'} as its instruction {k}, "
        f"where its bound plan has {want[k] if k < len(want) else 'nothing more'}"
    )


def stage_buckets(cfg: GPTConfig, split, n: int) -> tuple[tuple[str, ...], ...]:
    """`n` DDP buckets a stage, its layers cut evenly, each stage's last layers first (as a
    ddp block in a pipeline file lists them: PipelineSpec.buckets)."""
    out = []
    for layers in reversed(split):
        cut = [layers[i * len(layers) // n : (i + 1) * len(layers) // n] for i in range(n)]
        for part in reversed([c for c in cut if c]):
            out.append(tuple(p.name for layer in part for p in cfg.layer_params(layer)))
    return tuple(out)


def pool_comm(rank: int, groups, pipe, world: int, dp: int, mesh=None):
    """This rank's PipeComm on the pool: one replica on the pool's groups, the tied pair the
    ranks of the first and last stage where they differ (no pair where one rank holds both,
    as on a V), or make_comm's groups for DP x PP."""
    from schedc.exec.pipeline_comm import PipeComm

    if dp > 1:
        return dp_comm(rank, world, pipe, mesh)
    first, last = pipe.rank_of(0), pipe.rank_of(pipe.stages - 1)
    return PipeComm(rank, groups[pipe.pp], groups.get(("ends", pipe.pp)) if first != last else None)


_COMMS: dict = {}


def dp_comm(rank: int, world: int, pipe, mesh=None):
    """make_comm's groups, made once per layout in this worker: every rank of the pool gets
    the same jobs in the same order, so each makes the same groups in the same order (the
    pool's default group is its 4 ranks: a DP x PP case uses all of them)."""
    import torch.distributed as dist

    from schedc.exec.pipeline_comm import make_comm

    assert world == dist.get_world_size(), "a DP x PP case takes the whole pool"
    key = (rank, world, pipe.pp, pipe.rank_of(0), pipe.rank_of(pipe.stages - 1), mesh)
    if key not in _COMMS:
        _COMMS[key] = make_comm(rank, world, pipe, mesh)
    return _COMMS[key]


@lru_cache(maxsize=128)
def reference(case: Case) -> tuple:
    """The single-process steps of the case's global batch, m micro-batches, one thread."""
    import torch

    from schedc.model.reference import Reference

    cfg = case.config
    data = batches(case.seq_len, case.m * case.micro * case.dp, cfg.vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = getattr(torch, case.dtype)
        low = case.torch_dtypes()
        ref = Reference(
            cfg,
            case.optim,
            data,
            case.micro,
            case.steps,
            case.seed,
            dtype,
            compute=low["compute"],
            param_dtype=low["gather"],
        )
        return tuple(ref.step() for _ in range(case.steps))
    finally:
        torch.set_num_threads(threads)


@dataclass
class Merged:
    steps: list


def merged(per_rank: list[list]) -> Merged:
    """Every rank's parameters and gradients in one step record per step. Each parameter is
    on one rank, except the tied wte.weight, whose two copies must be bitwise equal."""
    import torch

    out = []
    for stats in zip(*per_rank, strict=True):
        first = stats[0]
        for s in stats[1:]:
            assert (s.loss, s.grad_norm, s.lr) == (first.loss, first.grad_norm, first.lr)
            for what in ("grads", "params"):
                mine, theirs = getattr(first, what), getattr(s, what)
                for name in mine.keys() & theirs.keys():
                    assert name == "wte.weight", f"{name} is on two ranks"
                    assert torch.equal(mine[name], theirs[name]), f"the tied copies' {what} differ"
                mine.update(theirs)
        out.append(first)
    return Merged(out)


def replicas(per_rank: list[list], case: Case) -> list[list]:
    """Replica 0's ranks' steps, after showing every other replica's parameters, gradients,
    loss and norm bitwise equal to replica 0's at every step (global rank p x dp + d)."""
    import torch

    for p in range(case.pp):
        mine = per_rank[p * case.dp]
        for d in range(1, case.dp):
            for a, b in zip(mine, per_rank[p * case.dp + d], strict=True):
                assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm), (p, d, a.step)
                for what in ("grads", "params"):
                    ours, theirs = getattr(a, what), getattr(b, what)
                    assert ours.keys() == theirs.keys()
                    for name in ours:
                        assert torch.equal(ours[name], theirs[name]), (what, name, p, d, a.step)
    return [per_rank[p * case.dp] for p in range(case.pp)]


def run_file(rank: int, groups, path: str, precision: str | None, steps: int) -> list:
    """This rank's steps of a bundled pipeline schedule (under `precision`, a named policy,
    if given), as `schedc run` builds its job (exec/pipeline_train.py), on the pool's ranks."""
    ex = file_executor(rank, groups, path, precision, steps)
    return steps_as_bound(ex, steps)


def file_executor(rank: int, groups, path: str, precision: str | None, steps: int, record=True):
    """The executor `schedc run` would build for this rank of a bundled pipeline file."""
    from schedc.compiler import compile_file
    from schedc.exec.pipeline import PipelineExecutor
    from schedc.exec.pipeline_model import PipeJob
    from schedc.exec.pipeline_train import precision as job_precision
    from schedc.lang.resolve import Overrides
    from schedc.passes.pipeline_bind import bind_rank

    c = compile_file(path, Overrides(steps=steps, precision=precision))
    spec, plan = c.spec, c.pipeline
    assert spec.pipeline is not None and plan is not None
    pipe = plan.pipeline
    data = batches_of(spec)
    split = tuple(st.layers for st in spec.pipeline.stages)
    job = PipeJob(spec.model, split, data, spec.optim, steps, spec.seed, **job_precision(spec))
    comm = pool_comm(rank, groups, pipe, spec.world, spec.dp, spec.declared_mesh)
    bound = bind_rank(spec, pipe, plan.programs, rank)
    return PipelineExecutor(job, pipe, comm, bound, record=record)


def measure_file(rank: int, groups, path: str, steps: int = 3) -> int:
    """This rank's measured peak memory in a step of a bundled pipeline file, as the DP
    executor measures its own (tests/exec/test_memory_measured.py): the live heap's growth
    in each step after the first (which creates AdamW's moments), over what lives between
    steps (the parameters, their gradients and the moments: the states the ledger counts),
    read every millisecond and between the program's items by schedc/exec/heap.py (what
    `schedc run` of a pipeline measures: exec/pipeline_train.py)."""
    from schedc.exec.heap import HeapPeak, keep_freed_memory
    from schedc.exec.pipeline_train import held_bytes

    keep_freed_memory()
    ex = file_executor(rank, groups, path, None, steps, record=False)
    ex.step()
    peak = 0
    for _ in range(steps - 1):
        held = held_bytes(ex)
        with HeapPeak() as heap:
            ex.step()
        peak = max(peak, held + heap.grew)
    return peak


def batches_of(spec):
    from schedc.model.data import load_batches

    return load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)

"""The pipeline executor's test cases, run on the pool's ranks (tests/pool.py `Call`) and,
for comparison, by the single-process reference.

    pool.call("tests.pipeline_ranks:run_case", case.pp, case)  -> every rank's StepStats
    reference(case)                                           -> the oracle's StepResults
    merged(per_rank)                                          -> one result for the oracle
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from schedc.model.arch import SIZES, GPTConfig
from schedc.model.config import DataConfig, OptimConfig
from schedc.passes.pipeline_gen import Request, Schedule


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

    def __str__(self) -> str:
        v = f"-v{self.v}" if self.v > 1 else ""
        cut = "-" + ".".join(map(str, self.sizes)) if self.sizes else ""
        dtype = "" if self.dtype == "float32" else f"-{self.dtype}"
        return f"{self.schedule.value}{v}-pp{self.pp}-m{self.m}{cut}-{self.steps}steps{dtype}"

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
    def request(self) -> Request:
        return Request(self.schedule, self.pp, self.m, self.v)


@lru_cache(maxsize=8)
def batches(seq_len: int, seqs: int, vocab: int):
    from schedc.model.data import load_batches

    return load_batches(DataConfig(), seq_len, seqs, vocab)


def run_case(rank: int, groups, case: Case) -> list:
    """This rank's steps of the case (StepStats with its own gradients and parameters)."""
    import torch

    from schedc.exec.pipeline import PipeComm, PipeJob, PipelineExecutor
    from schedc.passes.pipeline_gen import generate

    gen = generate(case.request)
    cfg = case.config
    data = batches(case.seq_len, case.m * case.micro, cfg.vocab_size)
    split = case.split(gen.pipeline.stages)
    job = PipeJob(cfg, split, data, case.optim, case.steps, case.seed, getattr(torch, case.dtype))
    comm = PipeComm(rank, groups[case.pp], groups.get(("ends", case.pp)))
    ex = PipelineExecutor(job, gen, comm, record=True)
    return [ex.step() for _ in range(case.steps)]


@lru_cache(maxsize=128)
def reference(case: Case) -> tuple:
    """The single-process steps of the case's global batch, m micro-batches, one thread."""
    import torch

    from schedc.model.reference import Reference

    cfg = case.config
    data = batches(case.seq_len, case.m * case.micro, cfg.vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = getattr(torch, case.dtype)
        ref = Reference(cfg, case.optim, data, case.micro, case.steps, case.seed, dtype)
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

"""A pipeline run's `eval { ... }`: a pipeline rank as exec/evaluate.py reads a run.

Evaluation reads the model with every parameter (evaluate.py `FullModel`), as a DP FSDP run
gathers its shards into a copy: here every rank takes each parameter from replica 0 of the
first pipeline rank holding it (a broadcast over the job's ranks; under FSDP per stage, after
that rank gathers its units over its shard group). The validation batches are read where the
training batch is: on the ranks of the first stage, each its replica's slices (together every
sequence once); HellaSwag's examples are split over every rank, and rank 0 samples. So the
records are a DP run's, of the same weights.

    Evaluations(Evaluated(compiled, ex, comm, opts), val, hellaswag)   # exec/evaluate.py
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from schedc.compiler import Compiled
from schedc.exec.options import Comm, RunOptions
from schedc.exec.pipeline import PipelineExecutor
from schedc.passes.pipeline_bind import held_params


class Evaluated:
    """What exec/evaluate.py reads of a run, for a pipeline rank (the module docstring)."""

    def __init__(self, compiled: Compiled, ex: PipelineExecutor, comm: Comm, opts: RunOptions):
        spec, pipe = compiled.spec, ex.pipe
        # the copy evaluation builds is in the dtype the stages keep their weights in
        self.spec, self.ex, self.comm = spec, ex, comm
        self.opts = dataclasses.replace(opts, dtype=ex.job.dtype)
        self.device, self.model = torch.device("cpu"), None  # never whole on a rank
        dp = spec.dp
        # the validation slices: the first stage's ranks read their replica's, the rest none
        bound = compiled.bound(comm.rank)
        if comm.rank // dp != pipe.rank_of(0):
            bound = dataclasses.replace(bound, batch=tuple((0, 0) for _ in bound.batch))
        self.bound = bound
        # each parameter from replica 0 of the first pipeline rank that holds it
        held = [set(held_params(spec, pipe, p)) for p in range(pipe.pp)]
        self.owner = {
            q.name: next(p for p in range(pipe.pp) if q.name in held[p]) * dp
            for q in spec.model.params
        }
        self.compute = ex.job.compute  # the autocast dtype of forward; None: the weights'

    @property
    def step_index(self) -> int:
        return self.ex.step_index

    def autocast_forward(self):
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.compute)

    def full_tensors(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (a collective every rank joins)."""
        assert not grad, "evaluation reads parameters"
        mine = self.ex.sync.full_tensors(grad=False)  # FSDP per stage: its shard group's
        out = {}
        for q in self.spec.model.params:
            src = self.owner[q.name]
            t = mine[q.name] if self.comm.rank == src else torch.empty(q.shape, dtype=self.dtype)
            dist.broadcast(t, src, group=self.comm.group)  # type: ignore[arg-type]
            out[q.name] = t
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.opts.dtype

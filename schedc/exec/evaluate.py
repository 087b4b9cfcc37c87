"""Validation loss between steps (`eval { val_every = N  val_batches = M }`), as build-nanogpt
measures it: the mean cross-entropy over M global batches of the `val` shards.

Each rank reads the positions of each global batch its bound plan reads in training
(ir/bound.py: together every sequence once), forwards them without autograd under the
schedule's compute dtype, and the token-weighted sum is all-reduced in float64. It is outside
the step's plan and its proof: it reads the parameters after an update and changes none.
Under FSDP the parameters are gathered from the shards into a model of their own, kept for
the run: a full copy of the parameters on every rank while validation runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from schedc.exec.executor import Executor
from schedc.ir.spec import Strategy
from schedc.model.data import GlobalBatches
from schedc.model.gpt2 import GPT
from schedc.model.reference import init_model


class Validation:
    """`loss()` after a step: the validation stream's mean loss, the same on every rank."""

    def __init__(self, ex: Executor, val: GlobalBatches, batches: int):
        self.ex, self.val, self.batches = ex, val, batches
        self._copy: GPT | None = None  # FSDP's gathered model

    def due(self, step_index: int) -> bool:
        """After every `val_every` steps and after the last (step_index: steps done)."""
        every, steps = self.ex.spec.evaluation.val_every, self.ex.spec.steps
        return every > 0 and (step_index % every == 0 or step_index == steps)

    @torch.no_grad()
    def loss(self) -> float:
        ex = self.ex
        model = self._model()
        total = torch.zeros((), dtype=torch.float64, device=ex.device)
        for b in range(self.batches):
            for mb in range(ex.spec.accum):
                x, y = self.val.rows(b, ex.bound.positions(mb))
                with ex.autocast_forward():
                    _, loss = model(x.to(ex.device), y.to(ex.device))
                total += loss.double() * x.numel()
        if ex.comm.world > 1:
            dist.all_reduce(total, group=ex.comm.group)
        return total.item() / (self.batches * ex.spec.seqs * ex.spec.seq_len)

    def _model(self) -> GPT:
        ex = self.ex
        if ex.spec.kind is not Strategy.FSDP:
            return ex.model  # every rank holds every parameter, updated in place
        full = ex.full_tensors(grad=False)  # a collective: every rank gathers
        if self._copy is None:
            self._copy = init_model(ex.spec.model, ex.spec.seed, ex.opts.dtype).to(ex.device)
        for name, p in self._copy.named_parameters():
            p.copy_(full[name])
        return self._copy

"""The pipeline executor: one rank's proven bound plan (passes/pipeline_bind.py) run on its
stages; the proof (passes/prove.py) is the compiler's, before any rank starts.

    ex = PipelineExecutor(job, pipe, comm, bound)   # bound: the rank's plan (pipeline_bind)
    stats = ex.step()     # one optimizer step over the global batch's m micro-batches

Each item of the rank's program runs in order (`Runner`, one small function a kind):
- F[s]@j: the stage's layers on micro-batch j: tokens on stage 0 (the positions of the
  global batch the rank's bound plan gives micro-batch j, as the proof read them), else the
  activation the previous stage made (received, or local when that stage is on this rank),
  detached so the stage's backward stops at its input. The last stage makes the loss of its
  micro-batch.
- B[s]@j: backward of the stage from the output's gradient (received or local), or from
  loss_j / m on the last stage (the reference's accumulation: the mean loss's gradient);
  the input's gradient is kept for SEND_B or the local stage before.
- I[s]@j / W[s]@j (zero bubble): I is the backward to the stage's input only, keeping
  the gradients that reach the nodes where the parameters' branches leave the input's
  path (a linear's matmul, a LayerNorm); W runs the parameters' branches from those
  gradients alone. This is torch's stage_backward_input / stage_backward_weight
  (torch.distributed.pipelining._backward, the autograd half of its zero-bubble stages,
  used here as a library: the schedule is schedc's). A W that ran the whole backward again
  to the parameters would redo the input's path: measured on the 2-core CPU, ZB-V took
  1.55x 1F1B's step that way (482 ms against 312). Stage 0 has no input to differentiate:
  its I does nothing and its W the whole backward.
- a P2P item, one transfer or a group: `batch_isend_irecv` of its sends and receives,
  posted in the program's order and not waited for there (`transfer`): a receive is waited
  for just before the compute that reads it, a send at the step's end at the latest
  (exec/pipeline_comm.py: `awaited`, `Posted`, and why the proof still holds). Untagged, as
  proven: the transport pairs the k-th send a -> b with the k-th receive.

Data parallelism per stage across replicas (DDP or FSDP under PP) is a `StageSync`
(exec/pipeline_sync.py) the executor owns and calls at a few points: before a stage's
forward, around a backward that writes a stage's weights, after each action (the
reductions of the gradients it completes), at the step's end (their waits) and in the
update (the gradients and whether this rank's squares count in the norm).

After the program, the update (`update`): the sync's gradients, the tied embedding's two
copies (first stage's embed, last stage's head) summed over the 2-rank group of those ranks;
the global gradient norm is the square root of the all-reduced sum of each rank's squared
norms, the tied weight counted once (on the embed's rank), with dp > 1 in the same
all-reduce over every rank as the losses, whose sum over m x dp micro-batches is the global
mean; clipping by it; then AdamW with the reference's groups and kernels
(model/reference.py make_adamw) at the spec's learning-rate schedule. Both copies of wte see
the same gradient, state and step, so they stay bitwise equal.

Numerics (`PipeJob.compute/gather/reduce`, the schedule's precision policy): autocast in the
compute dtype around each forward, units gathered in the gather dtype, dp reductions in the
reduce dtype (the last two exec/pipeline_sync.py's); P2P carries the residual stream in the
dtype of the weights the layers compute with (`wire`), and each send asserts it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from schedc.analysis.pipeline_trace import ItemSpan
from schedc.errors import RunError
from schedc.exec.options import StepStats
from schedc.exec.pipeline_comm import PipeComm, Posted, awaited
from schedc.exec.pipeline_model import PipeJob, RankModel, check_split
from schedc.exec.pipeline_sync import stage_sync
from schedc.exec.update import nonfinite_flag
from schedc.ir.bound import Bound
from schedc.ir.op import STEP, Kind, Op, stage_op
from schedc.ir.pipeline import Item, Pipeline, format_item, items_of
from schedc.model.reference import clip_coef


@dataclass
class Flight:
    """One step's tensors in flight, by (stage, micro-batch), each dropped once used."""

    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    received: dict[Op, torch.Tensor] = field(default_factory=dict)
    # I done, W to come: what the W needs (stage 0: its output and gradient; else the
    # gradients I kept at the parameters' branches)
    weights: dict[tuple[int, int], Any] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


class PipelineExecutor:
    """Runs one rank's program of a proven pipeline schedule, step after step."""

    def __init__(
        self,
        job: PipeJob,
        pipe: Pipeline,
        comm: PipeComm,
        bound: Bound,
        record: bool = False,
        timed: bool = False,
    ):
        check_split(job.model, job.split)
        if len(job.split) != pipe.stages:
            raise ValueError(f"{len(job.split)} stages split, the schedule has {pipe.stages}")
        if job.batches.global_seqs % (pipe.microbatches * comm.replicas):
            raise ValueError(
                f"{job.batches.global_seqs} sequences do not split into {pipe.microbatches} "
                f"equal micro-batches on each of {comm.replicas} replicas"
            )
        self.job, self.pipe, self.comm, self.record = job, pipe, comm, record
        # the rank's bound plan's stage ops, in its order: what the proof read is what runs
        self.program: list[Item] = items_of(bound.plan.instrs)
        _one_update_last(bound)
        self.stages = pipe.stages_of(comm.rank)
        layers = [name for s in self.stages for name in job.split[s]]
        self.model = RankModel(job.model, layers, job.seed, job.dtype, job.weights)
        self.named = list(self.model.named_parameters())
        # the rank's bound plan (passes/pipeline_bind.py): the operands the proof read
        self.bound, self.loss_scale = bound, bound.loss_scale
        self.sync = stage_sync(job, comm, self.model, self.stages, bound)
        self.optimizer = self.sync.optimizer()
        self.micro = job.batches.global_seqs // (pipe.microbatches * comm.replicas)
        self.peers = [comm.global_rank(r) for r in range(pipe.pp)]
        # what P2P carries: the residual stream, in the dtype of the weights the layers
        # compute with (autocast's bf16 branches are added to it in its own dtype)
        self.wire = self.sync.wire
        self.step_index = 0
        self.reads = awaited(self.program)
        self.posted = Posted()
        self.rank = comm.me  # global
        self.spans: list[ItemSpan] | None = [] if timed else None
        """With `timed`: each item's start and end, every step (perf_counter: the host's
        monotonic clock, one for its ranks), for a trace (analysis/pipeline_trace.py)."""

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        self.sync.begin_step()
        flight = Flight()
        spans, i = self.spans, 0
        try:  # one handler for the program: the failing item is `i`
            for i, item in enumerate(self.program):
                for recv in self.reads[i]:  # what this compute reads, received: waited now
                    self.posted.wait_recv(recv)
                start = time.perf_counter() if spans is not None else 0.0
                with _range(item):
                    self.run_item(item, flight)
                if spans is not None:  # a compute's start is after its receive arrived
                    end = time.perf_counter()
                    spans.append(ItemSpan(self.rank, self.step_index, i, start, end))
            self.posted.drain()
        except Exception as e:
            raise RunError(
                f"pipeline rank {self.comm.rank}, step {self.step_index}: "
                f"{type(e).__name__}: {e}\n{self.render(i)}"
            ) from e
        left = flight.inputs or flight.received or flight.grads_in or flight.weights
        assert not left, "tensors left over after the program"
        self.sync.wait()
        stats = self.update(flight.losses)
        stats.dt_ms = (time.perf_counter() - t0) * 1e3
        tokens = self.job.batches.global_seqs * self.job.batches.seq_len
        stats.tokens_per_s = tokens / max(stats.dt_ms / 1e3, 1e-9)
        self.step_index += 1
        return stats

    def render(self, failed: int) -> str:
        """The rank's program, one item a line, the failing one marked."""
        lines = [f"{i:>4} {format_item(it)}" for i, it in enumerate(self.program)]
        lines[failed] += "   <-- ERROR HERE"
        return "\n".join(lines)

    def run_item(self, item: Item, flight: Flight) -> None:
        for act in item:
            self.sync.before(act)
            self.sync.issue(act, self._pair(act))
        if item[0].kind.is_p2p:
            self.transfer(item, flight)
            return
        (act,) = item
        RUN[act.kind](self, act, flight)
        self.sync.after_compute(act)

    # -- compute -----------------------------------------------------------------------------

    def forward(self, act: Op, flight: Flight) -> None:
        s, j = act.stage, act.mb
        last = s == self.pipe.stages - 1
        x, y = self.job.batches.rows(self.step_index, self.bound.positions(j))  # as proven
        if s > 0:
            x = self._input(act, flight).detach().requires_grad_()
        flight.inputs[(s, j)] = x
        self.sync.before_forward(s)
        with self._autocast():
            out = self.model.run(self.job.split[s], x, y if last else None)
        if last:
            flight.losses.append(out.detach())
            out = _scaled(out, self.loss_scale)  # the reference's loss_j / k, as proven
        flight.outputs[(s, j)] = out

    def _input(self, act: Op, flight: Flight) -> torch.Tensor:
        s, j = act.stage, act.mb
        if self.pipe.local(s - 1, s):
            return flight.outputs[(s - 1, j)]
        return flight.received.pop(stage_op(Kind.RECV_F, s, j))

    def _grad_out(self, act: Op, flight: Flight) -> torch.Tensor | None:
        s, j = act.stage, act.mb
        if s == self.pipe.stages - 1:
            return None  # the loss: its gradient is 1
        if self.pipe.local(s + 1, s):
            return flight.grads_in.pop((s + 1, j))
        return flight.received.pop(stage_op(Kind.RECV_B, s, j))

    def backward(self, act: Op, flight: Flight) -> None:
        key = (act.stage, act.mb)
        out, grad = flight.outputs.pop(key), self._grad_out(act, flight)
        self.sync.before_backward(act.stage)
        torch.autograd.backward(out, grad)
        self.sync.after_backward(act.stage)
        self._keep_input_grad(key, flight.inputs.pop(key), flight)

    def backward_input(self, act: Op, flight: Flight) -> None:
        """I: the input's gradient only; what W needs is kept (the module docstring)."""
        key = (act.stage, act.mb)
        out, grad, inp = (
            flight.outputs.pop(key),
            self._grad_out(act, flight),
            flight.inputs.pop(key),
        )
        if act.stage == 0:
            flight.weights[key] = (out, grad)
            return
        # imported here: torch.distributed.pipelining takes 0.8 s to import (sympy, its IR),
        # which only a schedule with a split backward should pay
        from torch.distributed.pipelining._backward import stage_backward_input

        grads = None if grad is None else [grad]
        _, groups = stage_backward_input([out], grads, [inp], iter(self._weights(act.stage)))
        self._keep_input_grad(key, inp, flight)
        flight.weights[key] = groups

    def backward_weight(self, act: Op, flight: Flight) -> None:
        """W: the parameters' gradients, from what I kept."""
        kept = flight.weights.pop((act.stage, act.mb))
        weights = self._weights(act.stage)
        self.sync.before_backward(act.stage)
        if act.stage == 0:
            out, grad = kept
            torch.autograd.backward(out, grad, inputs=weights)
        else:
            from torch.distributed.pipelining._backward import stage_backward_weight

            stage_backward_weight(iter(weights), kept)
        self.sync.after_backward(act.stage)

    def _weights(self, stage: int) -> list[nn.Parameter]:
        """The stage's parameters, each once (the head's tied copy among them)."""
        params = {id(p): p for name in self.job.split[stage] for p in self.model.layer_params(name)}
        return list(params.values())

    def _autocast(self):
        """The compute dtype's autocast around a forward (the DP executor's
        `autocast_forward`); backward runs outside it, in the dtypes autocast chose."""
        if self.job.compute is None or self.job.compute == self.job.dtype:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.job.compute)

    def _keep_input_grad(self, key: tuple[int, int], inp: torch.Tensor, flight: Flight) -> None:
        if key[0] > 0:
            assert inp.grad is not None
            flight.grads_in[key] = inp.grad

    # -- communication -----------------------------------------------------------------------

    def transfer(self, item: Item, flight: Flight) -> None:
        """A send, a receive or a group of them, posted together (`batch_isend_irecv`, in
        the program's order) and not waited for here: a receive is waited for by the
        compute that reads it (`self.reads`), a send once done or at the step's end
        (`Posted`; exec/pipeline_comm.py's docstring says why the proof still holds)."""
        ops, kinds = [], []
        for act in item:
            peer = self.peers[self.pipe.peer(act)]
            if act.kind.is_send:
                tensor = self._payload(act, flight)
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.comm.group))
            else:
                tensor = torch.empty(self._shape(), dtype=self.wire)
                flight.received[act] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.comm.group))
            kinds.append((act, tensor))
        self.posted.add(kinds, dist.batch_isend_irecv(ops))

    def _pair(self, act: Op) -> tuple[int, ...]:
        """A transfer's (sender, receiver) as pipeline ranks of this replica (ir/bound.py);
        () for a compute."""
        if not act.kind.is_p2p:
            return ()
        me, peer = self.comm.rank, self.pipe.peer(act)
        return (me, peer) if act.kind.is_send else (peer, me)

    def _payload(self, send: Op, flight: Flight) -> torch.Tensor:
        key = (send.stage, send.mb)
        if send.kind is Kind.SEND_F:
            out = flight.outputs[key].detach().contiguous()
        else:
            out = flight.grads_in.pop(key).contiguous()
        assert out.dtype == self.wire, f"{send}: {out.dtype} where the peer receives {self.wire}"
        return out

    def _shape(self) -> tuple[int, int, int]:
        return (self.micro, self.job.batches.seq_len, self.job.model.n_embd)  # (B, T, C)

    # -- the update --------------------------------------------------------------------------

    def update(self, losses: list[torch.Tensor]) -> StepStats:
        """Tied gradients summed, global norm, clipping, AdamW (skipped on the device where
        the loss or norm is not finite, exec/update.py); the step's loss and norm, and this
        rank's micro-batch losses kept (`losses`: for naming a non-finite one)."""
        self.losses = losses
        job, opt, c = self.job, self.job.optim, self.comm
        grads, counted = self.sync.grads()
        sq = torch.stack(torch._foreach_norm(counted)).square().sum() if counted else None
        totals = torch.zeros(2, dtype=torch.float64)
        mine = sq is not None and self.sync.counts_norm
        totals[0] = sq.double() if mine and sq is not None else 0.0
        totals[1] = torch.stack(losses).double().sum() if losses else 0.0
        dist.all_reduce(totals, group=c.group if c.replicas == 1 else c.world)
        norm = totals[0].sqrt().to(job.dtype)
        bad = nonfinite_flag(totals[1], norm)  # both global: every rank skips alike
        lr = opt.lr_at(self.step_index, job.steps)
        stats = StepStats(self.step_index, 0.0, lr, 0.0, 0.0, 0.0)
        if self.record:
            stats.grads = self.sync.full_tensors(grad=True)
        if opt.clip > 0:
            torch._foreach_mul_(grads, clip_coef(norm, opt.clip))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.sync.issue(STEP, ())
        self.optimizer.found_inf = bad  # type: ignore[attr-defined]  # fused AdamW: skipped at 1
        self.optimizer.step()
        if self.record:
            stats.params = self.sync.full_tensors(grad=False)
        self.sync.after_update()
        stats.loss = (totals[1] / (self.pipe.microbatches * self.comm.replicas)).item()
        stats.grad_norm = norm.item()
        return stats


def _one_update_last(bound: Bound) -> None:
    """The executor updates once, after the plan's every other instruction (`update`): a
    plan that says otherwise is not run (the proof refutes it: passes/prove_shape.py)."""
    instrs = bound.plan.instrs
    updates = [k for k, i in enumerate(instrs) if i.op is not None and i.op.kind is Kind.STEP]
    if updates != [len(instrs) - 1]:
        raise ValueError(
            f"rank {bound.rank}'s bound plan updates at instructions {updates} of "
            f"{len(instrs)}: a step is one update, after everything else"
        )


def _scaled(loss: torch.Tensor, scale: Fraction) -> torch.Tensor:
    """The loss times its scale: a division by k where the scale is 1/k (bitwise the
    reference's loss / k)."""
    return loss / scale.denominator if scale.numerator == 1 else loss * float(scale)


RUN = {
    Kind.F: PipelineExecutor.forward,
    Kind.B: PipelineExecutor.backward,
    Kind.I: PipelineExecutor.backward_input,
    Kind.W: PipelineExecutor.backward_weight,
}


def _range(item: Item):
    """A profiler range named by the item's IR text, when a profiler is listening (else
    nothing: a record_function costs a few microseconds an item)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(format_item(item))

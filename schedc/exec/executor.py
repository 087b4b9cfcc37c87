"""The executor: a compiled schedule becomes a real GPT-2 training step on every rank.

    torchrun --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp_overlap.sched
    python -m schedc run schedules/tiny_1gpu.sched            # world 1 needs no torchrun

Each step executes the rank's plan instruction by instruction: forward and backward one
layer at a time (the model is cut at layer boundaries: each layer's input is a detached
leaf, and each layer's backward is its own autograd.backward call), collectives issued on
their streams, events recorded and waited exactly where the plan says. Nothing here
decides an order; the plan does. The only communication outside the plan is start-up
agreement, the global gradient norm of FSDP (one scalar, inside the optimizer step) and
the logged loss (one scalar, after the step).

Composed of (torchtitan's apply_* steps, as objects): the backend (exec/backends.py, and
exec/cpu_backend.py or exec/cuda_backend.py: streams, events, collectives), the strategy
(exec/strategies.py: DDP's buckets or FSDP's units, and their collectives), the update
(exec/update.py: norm, clip, non-finite, AdamW). Each layer's forward runs under
`torch.autocast` in the compute dtype (its backward runs in the dtypes autocast chose, as
torch's AMP recipe has it; the loss is fp32). Master weights, the gradients the optimizer
reads and AdamW's moments stay in the run's dtype (fp32).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field

import torch

from schedc.analysis.trace.write import Timed, chrome_events
from schedc.compiler import Compiled
from schedc.errors import RunError
from schedc.exec.backends import Backend, nccl_launch_order
from schedc.exec.cpu_backend import CPUBackend
from schedc.exec.cuda_backend import CUDABackend
from schedc.exec.fuse import Segment, fuse
from schedc.exec.heap import HeapPeak
from schedc.exec.options import (
    TORCH_DTYPES,
    Collectives,
    Comm,
    RunOptions,
    StepStats,
    pick_device,
)
from schedc.exec.probe import probe_collectives, probe_compute, probe_micros, track
from schedc.exec.regions import CompileFailed, Regions, set_tf32
from schedc.exec.strategies import Replicated, Sharded
from schedc.exec.update import Pending, Update
from schedc.ir.op import COMPUTE, Kind, Op
from schedc.ir.plan import Action, Plan
from schedc.ir.spec import Dtype, Strategy
from schedc.model.data import load_batches
from schedc.model.reference import init_model

# -- the executor -------------------------------------------------------------------------------


def check_groups(spec, bound) -> None:
    """The backends run each collective over its mesh dimension's process group: a bound
    plan whose group is another cannot run as the proof read it."""
    for ins in bound.plan.instrs:
        if ins.op is not None and ins.op.is_collective:
            want = spec.mesh.members(bound.rank, spec.dim_of(ins.op))
            if ins.group != want:
                raise RunError(f"{ins.op}: the plan's group {ins.group} is not the mesh's {want}")


@dataclass
class _Micro:
    """What one micro-step keeps between its forward and its backward."""

    x: torch.Tensor
    y: torch.Tensor
    inp: dict[str, torch.Tensor] = field(default_factory=dict)  # each layer's input leaf
    out: dict[str, torch.Tensor] = field(default_factory=dict)  # each layer's output
    grad_in: dict[str, torch.Tensor] = field(default_factory=dict)  # d loss / d layer input
    loss: torch.Tensor | None = None


class Executor:
    """Runs one rank's plan, step after step."""

    def __init__(
        self, compiled: Compiled, comm: Comm, options: RunOptions | None = None, batches=None
    ):
        opts = self.opts = options or RunOptions()
        self.compiled, self.comm = compiled, comm
        spec = self.spec = compiled.spec
        if comm.world != spec.world:
            raise RunError(
                f"the schedule is for world {spec.world}, but this job has "
                f"{comm.world} rank{'s' if comm.world != 1 else ''}"
            )
        # the plan with this rank's operands (ir/bound.py): its batch slices, loss scale,
        # divisors, groups, buckets or shard; the proof checked exactly these
        self.bound = compiled.bound(comm.rank)
        check_groups(spec, self.bound)
        self.plan: Plan = self.bound.plan
        self.device = pick_device(opts.device)
        self.tf32 = set_tf32(self.device, spec.numerics.tf32)  # CUDA only; CPU untouched
        self.layers = spec.model.layers
        # each micro-batch's mean loss x 1/k (accumulation); the 1/D of averaging is applied
        # to a buffer right before it is summed across ranks (as DDP does), so a buffer that
        # already holds earlier micro-steps' averaged gradients stays correct when summed
        self.loss_scale = float(self.bound.loss_scale)
        self.model = self._model()
        # what each compute segment calls: eager, or compiled once per region (`compile on`)
        self.regions = Regions(self.model, spec.numerics.compile)
        self.params = dict(self.model.named_parameters())
        if batches is None:
            batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
        self.batches = batches
        # the policy: None where a dtype is the run's own (no autocast, no cast)
        num, master = spec.numerics, opts.dtype
        self.autocast = TORCH_DTYPES[num.compute] if num.compute is not Dtype.FP32 else None
        reduce = TORCH_DTYPES[num.reduce] if num.reduce is not Dtype.FP32 else master
        gather = TORCH_DTYPES[num.gather] if num.gather is not Dtype.FP32 else master
        self.backend = self._backend()
        log = self._log if opts.log_buffers else None
        if spec.kind is Strategy.FSDP:
            self.strategy: Replicated | Sharded = Sharded(
                spec, self.bound, comm, self.backend, self.params, reduce, log, gather, opts.measure
            )
        else:
            self.strategy = Replicated(
                spec, self.bound, comm, self.backend, self.params, reduce, log
            )
        self.optimizer = self.strategy.optimizer()
        self.update = Update(spec, comm, self.strategy, self.optimizer, opts)
        self._fused: tuple[Plan, list] | None = None
        self.step_index = 0
        self.t0 = 0.0  # the current step's start (perf_counter)
        self.micro: list[_Micro] = []  # the current step's micro-steps
        self.pending: Pending | None = None  # the current step's update, once enqueued
        self.at: int | None = None  # the instruction being executed, for failure reports
        self.mem: dict[str, int] = {}
        self.trace_spans: list[tuple[int, Timed]] = []
        self.trace_steps: list[tuple[int, int, int]] = []  # (step, start, end), ns, as spans
        self.probe_events: list[dict] = []
        # (step, instruction, action, buffer) with RunOptions.log_buffers; the instruction is
        # the first of its item (a fused run of compute ops is one item)
        self.buffer_log: list[tuple[int, int | None, str, str]] = []

    def _model(self):
        """GPT-2 as the schedule sets it up: the head's chunked loss (`loss chunk N`), the
        executor's 1/k folded into it, and, eagerly, every .grad a permanent view of a flat
        buffer that wte's backward adds into in place (compiled regions keep autograd's)."""
        spec = self.spec
        return init_model(
            spec.model,
            spec.seed,
            self.opts.dtype,
            loss_chunk=spec.numerics.loss_chunk,
            embed_into_grad=not spec.numerics.compile,
            loss_scale=self.loss_scale,
        ).to(self.device)

    def _backend(self) -> Backend:
        spec, opts = self.spec, self.opts
        streams = tuple(spec.stream_names())  # every rank builds the same stream groups
        if self.device.type != "cuda":
            return CPUBackend(streams, self.comm, opts.trace, spec.mesh, spec.dims())
        if opts.collectives is Collectives.NCCL:  # train.py set it before any communicator
            nccl_launch_order(len(collective_streams(self.plan)))
        return CUDABackend(
            streams,
            self.comm,
            opts.trace,
            self.device,
            opts.collectives.value,
            spec.mesh,
            spec.dims(),
        )

    @property
    def units(self):
        """FSDP's units by name ({} for DDP and one process)."""
        return self.strategy.units

    @property
    def buckets(self):
        """DDP's (or one process's) gradient buckets by name ({} for FSDP)."""
        return self.strategy.buckets

    @property
    def pending_frees(self):
        return self.strategy.pending_frees

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> StepStats:
        spec, s = self.spec, self.step_index
        t0, t0_ns = time.perf_counter(), time.perf_counter_ns()  # the clock of Timed spans
        self.t0 = t0
        self.micro = [
            _Micro(
                *(
                    t.to(self.device, non_blocking=True)
                    for t in self.batches.rows(s, self.bound.positions(j))
                )
            )
            for j in range(spec.accum)
        ]
        self.strategy.begin_step()
        self.pending = None
        if self.opts.heap and self.device.type == "cpu" and s > 0:  # step 0 creates AdamW's m, v
            # what lives before the plan runs: the states and this step's token batches
            held = self.update.state_bytes(with_grads=False) + sum(
                t.untyped_storage().nbytes() for m in self.micro for t in (m.x, m.y)
            )
            with HeapPeak() as heap:
                self.execute(heap.sample)
                self.strategy.reclaim(None)  # the step's last frees: no gather follows them
                self.backend.synchronize()
            self.mem["heap_peak"] = max(self.mem.get("heap_peak", 0), held + heap.grew)
        else:
            self.execute()
            self.strategy.reclaim(None)  # the step's last frees: no gather follows them
            if self.opts.sync_each_step or self.opts.trace:
                self.backend.synchronize()
        self.at = None  # between steps
        assert self.pending is not None, "the plan's step instruction enqueued the update"
        stats = self.update.finish(self.pending, self._losses())
        dt = time.perf_counter() - t0
        stats.dt_ms = dt * 1e3
        stats.tokens_per_s = spec.tokens_per_step / dt
        stats.comm_bytes = self.strategy.comm_bytes
        if self.opts.trace:
            self.trace_spans += [(s, sp) for sp in self.backend.spans]
            self.backend.spans.clear()
            self.trace_steps.append((s, t0_ns, time.perf_counter_ns()))
        self.step_index += 1
        return stats

    @property
    def items(self) -> list:
        """The plan with fusable compute runs grouped; when tracing every op runs alone, so
        each gets its own span. Recomputed if the plan object is replaced."""
        if self._fused is None or self._fused[0] is not self.plan:
            self._fused = (self.plan, fuse(self.plan, self.spec.model, enabled=not self.opts.trace))
        return self._fused[1]

    def execute(self, between=None) -> None:
        """Issue the plan, item by item; on failure, show where in the plan. `between` is
        called after each item (the heap's reading between ops)."""
        backend, instrs = self.backend, self.plan.instrs
        for item in self.items:
            if between is not None:
                between()
            k = self.at = item.first if isinstance(item, Segment) else item
            try:
                with _range(item if isinstance(item, Segment) else instrs[item]):
                    if isinstance(item, Segment):
                        self.compute(item)
                        continue
                    ins = instrs[item]
                    if ins.kind is Action.RUN:
                        self.run_op(ins.stream, ins.op, ins.keeps, ins.divisor)
                        if ins.op.kind is Kind.FREE and self.device.type == "cpu":
                            # a compute point is complete once marked and no stream reuses a
                            # block on a CPU: the storage goes right after the free, where the
                            # lifetimes say it goes, not at the next gather on its stream,
                            # which for a step's last units is past the update's temporaries
                            self.strategy.reclaim(None)
                    elif ins.kind is Action.RECORD:
                        backend.record(ins.stream, ins.event)
                    else:
                        backend.wait(ins.stream, ins.event)
            except CompileFailed as e:  # the compiler's failure, not the plan's
                raise RunError(str(e)) from None
            except Exception as e:
                raise PlanError(self.plan, k, self.comm.rank, self.step_index, e) from e

    def run_op(self, stream: str, op: Op, keeps: tuple[str, ...] = (), divisor: int = 1) -> None:
        """Issue `op` on `stream`; `keeps`: the buffers it reads that another stream
        allocated, which the plan says to keep alive on `stream` (ir/effects.py); `divisor`:
        a reduction's, of what this rank sends (ir/bound.py)."""
        kind = op.kind
        if kind is Kind.FREE:
            self.backend.compute(stream, op, lambda: self.strategy.free(op))
        elif kind is Kind.STEP:
            self.backend.compute(stream, op, lambda: self._update(keeps))
        elif kind.is_collective:
            self.strategy.collective(stream, op, keeps, divisor)
        elif kind is Kind.RECOMPUTE:
            self.backend.compute(stream, op, lambda: self._recompute(op))
        else:  # a forward or backward written outside the compute stream's fusable runs
            self.compute(Segment(kind, op.mb, (op.target,), -1))

    def _update(self, keeps: tuple[str, ...]) -> None:
        self.pending = self.update(self.step_index, self._losses(), self.t0, keeps)
        self.mem["states"] = self.update.states

    def _losses(self) -> list[torch.Tensor]:
        """Each micro-step's loss: the plan runs every forward before the update."""
        losses = [m.loss for m in self.micro if m.loss is not None]
        assert len(losses) == len(self.micro), "a micro-step's forward has not run"
        return losses

    # -- compute ------------------------------------------------------------------------------

    def compute(self, seg: Segment) -> None:
        op = seg.ops[0] if len(seg.layers) == 1 else seg.ops[-1]
        fn = self._forward if seg.kind is Kind.FWD else self._backward
        # No poll of finished collectives here: a collective is retired (its buffers, FSDP's
        # unsharded gradient and gloo's copy of it, dropped) only where the plan waits for it
        # or a later one on its stream, or at the update, as FSDP2 drops a reduce-scatter's
        # input once its wait completes; retiring whatever had finished by now made the peak
        # depend on timing, which the plan's lifetimes (ir/effects.py) cannot say.
        self.backend.compute(COMPUTE, op, lambda: fn(seg))

    def _forward(self, seg: Segment) -> None:
        mb, first, last = self.micro[seg.mb], seg.layers[0], seg.layers[-1]
        i = self.layers.index(first)
        if i == 0:
            inp = mb.x
        else:
            # cut the graph here: what is below runs its backward on its own, later
            inp = mb.out[self.layers[i - 1]].detach().requires_grad_()
        # a layer that recomputes (fuse gives it a segment of its own) keeps only its input:
        # its forward saves nothing for backward, and runs again at recompute[layer]
        again = first in self.spec.recompute
        with self.autocast_forward(), torch.no_grad() if again else contextlib.nullcontext():
            out = self.regions(first, last)(inp, mb.y if last == "head" else None)
        mb.inp[first], mb.out[last] = inp, out
        if last == "head":
            mb.loss = out.detach()

    def _recompute(self, op: Op) -> None:
        """The forward of a recomputing layer again, from its kept input, now with autograd:
        the same kernels on the same values (no dropout, no randomness in GPT-2's layers),
        so backward reads exactly the activations a plain forward would have saved."""
        mb, layer = self.micro[op.mb], op.target
        with self.autocast_forward():
            out = self.regions(layer, layer)(mb.inp[layer], mb.y if layer == "head" else None)
        mb.out[layer] = out

    def autocast_forward(self):
        """The compute dtype's autocast around a forward. Backward runs outside it: autograd
        replays each op in the dtype its forward ran in (torch's AMP recipe)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _backward(self, seg: Segment) -> None:
        mb, top, bottom = self.micro[seg.mb], seg.layers[0], seg.layers[-1]
        self.strategy.before_backward(seg)
        out, inp = mb.out.pop(top), mb.inp.pop(bottom)
        if top == "head":
            torch.autograd.backward(out * self.loss_scale)
        else:
            torch.autograd.backward(out, mb.grad_in.pop(self.layers[self.layers.index(top) + 1]))
        if bottom != self.layers[0]:
            assert inp.grad is not None, "a layer input's gradient, once its backward ran"
            mb.grad_in[bottom] = inp.grad
        self.strategy.after_backward(seg)

    # -- what it measured, traced and logged ----------------------------------------------------

    def _log(self, action: str, buffer: str) -> None:
        self.buffer_log.append((self.step_index, self.at, action, buffer))

    def full_tensors(self, *, grad: bool) -> dict[str, torch.Tensor]:
        """Full gradients or parameters by name (FSDP: gathered from the shards; a collective)."""
        return self.strategy.full_tensors(grad=grad)

    def memory(self) -> dict[str, int]:
        """Bytes schedc held on this rank, measured from the tensors themselves: the model
        states at the last update (parameters, gradients, Adam m and v), and the peaks of
        gathered units and unsharded gradients."""
        return {"states": 0, **self.strategy.mem, **self.mem, **self.backend.stats()}

    def close(self) -> None:
        self.backend.close()

    def probe(self) -> None:
        """Time every collective kind on the world's group, and the layers at other micro
        sizes, for the trace (exec/probe.py); every rank calls it, before step 0."""
        if not self.opts.trace:
            return
        spec, rank = self.spec, self.comm.rank
        tid = len(self.plan.streams) + 1  # after the streams and the steps track
        events = track(rank, tid)
        many = self.comm.world > 1  # the ranks time together, in step after barriers
        if many:
            events += probe_collectives(self.comm.group, rank, self.comm.world, self.device, tid)
        # a copy of the model as this executor set it up: its gradients are thrown away
        events += probe_compute(
            self._model(),
            spec.seq_len,
            probe_micros(spec.micro),
            self.autocast,
            self.device,
            rank,
            tid,
            self.comm.group if many else False,
        )
        self.probe_events = events

    def trace_events(self) -> list[dict]:
        ops = chrome_events(self.comm.rank, self.plan.streams, self.trace_spans, self.trace_steps)
        return ops + self.probe_events


def collective_streams(plan: Plan) -> set[str]:
    """The streams the plan issues collectives on (each is a communicator on a GPU)."""
    return {
        i.stream
        for i in plan.instrs
        if i.kind is Action.RUN and i.op is not None and i.op.is_collective
    }


def _range(item):
    """A profiler range named after the op(s), when a profiler is listening (else free)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    if isinstance(item, Segment):
        name = (
            str(item.ops[0])
            if len(item.layers) == 1
            else (f"{item.kind.value}[{item.layers[0]}..{item.layers[-1]}]@mb{item.mb}")
        )
    else:
        name = str(item.op) if item.op else str(item)
    return torch.profiler.record_function(name)


class PlanError(RunError):
    """An instruction of the plan failed: the message shows the plan around it."""

    def __init__(self, plan: Plan, index: int, rank: int, step: int, cause: BaseException):
        self.plan, self.index, self.rank, self.step, self.cause = plan, index, rank, step, cause
        lines = plan.render(mark=index).splitlines()
        head, body = lines[0], lines[1:]
        lo, hi = max(0, index - 12), min(len(body), index + 4)
        window = (
            [head] + (["  ..."] if lo else []) + body[lo:hi] + (["  ..."] if hi < len(body) else [])
        )
        cause_text = "".join(traceback.format_exception_only(type(cause), cause)).strip()
        super().__init__(
            f"rank {rank}, step {step}: instruction {index} "
            f"({plan.instrs[index]}) failed: {cause_text}\n" + "\n".join(window)
        )

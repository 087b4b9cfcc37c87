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

Numerics (`spec.numerics`, FSDP2's MixedPrecisionPolicy and DDP's bf16_compress_hook):
each layer's forward runs under `torch.autocast` in the compute dtype (its backward runs
in the dtypes autocast chose, as torch's AMP recipe has it; the loss is fp32). A DDP bucket
stays fp32; its all-reduce casts it into a buffer of the reduce dtype on the comm stream and
copies the average back. An FSDP unit is gathered in the gather dtype: the fp32 shard is cast
on the comm stream and the gathered parameters the layers compute with are in that dtype, so
are their unsharded gradients; the reduce-scatter casts them to the reduce dtype and adds the
result into the fp32 gradient shard. Master weights, the gradients the optimizer reads and
AdamW's moments stay in the run's dtype (fp32).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from schedc.analysis.trace import Timed, chrome_events
from schedc.compiler import Compiled
from schedc.errors import RunError
from schedc.exec.backends import CPUBackend, CUDABackend, nccl_launch_order
from schedc.exec.flat import FlatBucket, FlatUnit
from schedc.exec.fuse import Segment, fuse
from schedc.exec.heap import HeapPeak
from schedc.exec.probe import probe_collectives, probe_compute, probe_micros, track
from schedc.exec.regions import CompileFailed, Regions, set_tf32
from schedc.ir.effects import grad_buffer, grad_key, scatter_output, shard_grad, upcast
from schedc.ir.op import COMPUTE, Kind, Op
from schedc.ir.plan import Action, Plan
from schedc.ir.spec import SHARD, BucketSpec, Dtype, Strategy
from schedc.model.data import load_batches
from schedc.model.reference import (
    adamw_groups,
    clip_coef,
    global_grad_norm,
    init_model,
    make_adamw,
)

# -- who we are ---------------------------------------------------------------------------------


@dataclass
class Comm:
    """This process's place in the job: rank, world, the store and the group for extras."""

    rank: int
    world: int
    group: object | None = None  # None: the default (world) group
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)
    tag: str = "run"  # names this job's stream groups in the store (one per executor)

    @classmethod
    def from_env(cls, backend: str, timeout_s: float) -> Comm:
        """torchrun's environment (RANK, WORLD_SIZE, ...), or a one-process world without it."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if "RANK" in os.environ:
                try:
                    dist.init_process_group(backend, timeout=timeout)
                except dist.DistError as e:  # a rank that never joined (it failed first)
                    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    raise RunError(
                        f"the job's {os.environ.get('WORLD_SIZE', '?')} ranks did not all "
                        f"join within --timeout {timeout_s:g}s ({why}); a rank that failed "
                        "before joining says why in its own output"
                    ) from None
            else:
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
                )
        return cls(dist.get_rank(), dist.get_world_size(), None, timeout)


@dataclass
class RunOptions:
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0
    trace: bool = False
    dtype: torch.dtype = torch.float32
    record: bool = False  # keep full gradients and parameters of each step (tests)
    log: bool = True
    nonfinite: str = "stop"  # a non-finite loss or gradient norm: "stop" the run, or "skip"
    # the stream groups' backend on CUDA: "nccl", or "gloo" (several ranks on one GPU, tests)
    collectives: str = "nccl"
    # wait for the device at the end of every step; off, only the plan's events and the
    # step start order one step after the other (tests that nothing else is needed)
    sync_each_step: bool = True
    heap: bool = False  # CPU: measure each step's peak live heap (schedc/exec/heap.py)
    # FSDP: measure the gathered and unsharded-gradient peaks from the buffers after every
    # gather and backward (`memory()`); off, a step spends no host time on it
    measure: bool = True
    probe: bool = False  # with trace: time each collective kind first (exec/probe.py)
    # record every buffer the executor allocates, frees, hands to a collective and gets
    # back, by step and instruction (`Executor.buffer_log`; tests hold it against the plan's
    # lifetimes, ir/effects.py)
    log_buffers: bool = False


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    dt_ms: float
    tokens_per_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)  # per collective, this rank
    skipped: str = ""  # why this step's update was skipped (--nonfinite skip)
    issue_ms: float = 0.0  # host time from the step's start until its update was enqueued
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


TORCH_DTYPES = {Dtype.FP32: torch.float32, Dtype.BF16: torch.bfloat16, Dtype.FP16: torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RunError("--device cuda, but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name != "cpu":
        raise RunError(f"unknown device '{name}' (cpu, cuda or auto)")
    return torch.device("cpu")


# -- the executor -------------------------------------------------------------------------------


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
        self.compiled, self.comm, self.opts = compiled, comm, options or RunOptions()
        spec = self.spec = compiled.spec
        if comm.world != spec.world:
            raise RunError(
                f"the schedule is for world {spec.world}, but this job has "
                f"{comm.world} rank{'s' if comm.world != 1 else ''}"
            )
        self.plan: Plan = compiled.plan(comm.rank)
        self.device = pick_device(options.device)
        self.tf32 = set_tf32(self.device, spec.numerics.tf32)  # CUDA only; CPU untouched
        self.layers = spec.model.layers
        self.model = init_model(spec.model, spec.seed, options.dtype).to(self.device)
        self.model.loss_chunk = spec.numerics.loss_chunk  # `loss chunk N`: the head's chunked CE
        # every .grad is a permanent view of a flat buffer: eager layers add the tied weight's
        # gradients into it in place (compiled regions keep autograd's own backward)
        self.model.embed_into_grad = not spec.numerics.compile
        # what each compute segment calls: eager, or compiled once per region (`compile on`)
        self.regions = Regions(self.model, spec.numerics.compile)
        self.params = dict(self.model.named_parameters())
        if batches is None:
            batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
        self.batches = batches
        # the policy: None where a dtype is the run's own (no autocast, no cast)
        num, master = spec.numerics, options.dtype
        self.autocast = TORCH_DTYPES[num.compute] if num.compute is not Dtype.FP32 else None
        self.reduce_dtype = TORCH_DTYPES[num.reduce] if num.reduce is not Dtype.FP32 else master
        gather = TORCH_DTYPES[num.gather] if num.gather is not Dtype.FP32 else master
        # each micro-batch's mean loss x 1/k (accumulation); the 1/D of averaging is applied
        # to a buffer right before it is summed across ranks (as DDP does), so a buffer that
        # already holds earlier micro-steps' averaged gradients stays correct when summed
        self.loss_scale = 1.0 / spec.accum
        self.model.loss_scale = self.loss_scale  # the chunked head folds it in (model/gpt2.py)
        streams = tuple(spec.stream_names())  # every rank builds the same stream groups
        if self.device.type == "cuda":
            if options.collectives == "nccl":  # train.py set it before any communicator
                nccl_launch_order(len(collective_streams(self.plan)))
            self.backend = CUDABackend(
                streams,
                comm,
                options.trace,
                self.device,
                options.collectives,
                spec.mesh,
                spec.dims(),
            )
        else:
            self.backend = CPUBackend(streams, comm, options.trace, spec.mesh, spec.dims())
        self.buckets: dict[str, FlatBucket] = {}
        self.units: dict[str, FlatUnit] = {}
        self.upcast = False  # FSDP: no_sync accumulates in the reduce dtype (set below)
        if spec.kind is Strategy.FSDP:
            # units shard over the shard dimension: this rank holds shard `index` of `S`
            mesh = spec.mesh
            index, S = mesh.index(comm.rank, SHARD), mesh.shard
            # no_sync under a reduce dtype wider than the gather's: FSDP2's upcast, micro-steps
            # accumulate in the reduce dtype (flat.py FlatUnit.fold)
            self.upcast = upcast(spec)
            accumulate = self.reduce_dtype if self.upcast else None
            self.units = {
                u.name: FlatUnit(u, spec.model, self.params, index, S, gather, accumulate)
                for u in spec.strategy.units
            }
            if options.log_buffers:
                for u in self.units.values():
                    u.log = self._log
            decay, plain = [], []
            for u in self.units.values():
                d, p = u.optimizer_params()
                decay += d
                plain += p
            self.optimizer = adamw_groups(decay, plain, spec.optim)
            writers = {u.name: spec.writers(u.params) for u in spec.strategy.units}
            # the layer whose backward is a unit's last of a micro-step (its lowest writer)
            self.last_writer = {n: min(ws, key=spec.model.layer_index) for n, ws in writers.items()}
            # the units whose gradients each layer's backward writes into
            self.writes = {
                layer: [self.units[n] for n, ws in writers.items() if layer in ws]
                for layer in self.layers
            }
        else:
            if spec.kind is Strategy.DDP:
                specs = spec.strategy.buckets
            else:  # one process: a single flat gradient buffer, never communicated
                specs = (BucketSpec("grads", tuple(self.params), None, 0),)
            self.buckets = {b.name: FlatBucket(b, self.params) for b in specs}
            self.optimizer = make_adamw(self.params.items(), spec.optim)
        self._fused: tuple[Plan, list] | None = None
        # gathered units freed on compute whose storage is not yet given back: unit ->
        # (the free's mark on compute, the stream whose gather allocated the storage)
        self.pending_frees: dict[str, tuple[object, str]] = {}
        self.gathered_on: dict[str, str] = {}
        self.step_index = 0
        self.t0 = 0.0  # the current step's start (perf_counter)
        self.result: StepStats | None = None  # the current step's, made by its update
        self._update: tuple[torch.Tensor, torch.Tensor] | None = None  # its loss and norm
        self.at: int | None = None  # the instruction being executed, for failure reports
        self.mem = {"gathered_peak": 0, "grads_peak": 0}
        self.trace_spans: list[tuple[int, Timed]] = []
        # (step, instruction, action, buffer) with RunOptions.log_buffers; the instruction is
        # the first of its item (a fused run of compute ops is one item)
        self.buffer_log: list[tuple[int, int | None, str, str]] = []
        self.trace_steps: list[tuple[int, int, int]] = []  # (step, start, end), ns, as spans

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> StepStats:
        spec, s = self.spec, self.step_index
        t0, t0_ns = time.perf_counter(), time.perf_counter_ns()  # the clock of Timed spans
        self.t0 = t0
        self.micro = [
            _Micro(
                *(
                    t.to(self.device, non_blocking=True)
                    for t in self.batches.micro_batch(s, self.comm.rank, j, spec.micro, spec.world)
                )
            )
            for j in range(spec.accum)
        ]
        for b in self.buckets.values():
            b.flat.zero_()
        self.scattered: set[str] = set()  # units reduce-scattered so far this step
        # HSDP: (unit, micro-step) -> a reduce-scatter's output, for its replicate all-reduce
        self.scatter_out: dict[tuple[str, int], tuple] = {}
        self.comm_bytes: dict[str, int] = {}
        self.result: StepStats | None = None
        if self.opts.heap and self.device.type == "cpu" and s > 0:  # step 0 creates AdamW's m, v
            # what lives before the plan runs: the states and this step's token batches
            held = self._held_bytes() + sum(
                t.untyped_storage().nbytes() for m in self.micro for t in (m.x, m.y)
            )
            with HeapPeak() as heap:
                self.execute(heap.sample)
                self._reclaim(None)  # the step's last frees: no gather follows them
                self.backend.synchronize()
            self.mem["heap_peak"] = max(self.mem.get("heap_peak", 0), held + heap.grew)
        else:
            self.execute()
            self._reclaim(None)  # the step's last frees: no gather follows them in this step
            if self.opts.sync_each_step or self.opts.trace:
                self.backend.synchronize()
        self.at = None  # between steps
        stats = self._finish()
        dt = time.perf_counter() - t0
        stats.dt_ms = dt * 1e3
        stats.tokens_per_s = spec.tokens_per_step / dt
        stats.comm_bytes = self.comm_bytes
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
                        self.run_op(ins.stream, ins.op, ins.keeps)
                        if ins.op.kind is Kind.FREE and self.device.type == "cpu":
                            # a compute point is complete once marked and no stream reuses a
                            # block on a CPU: the storage goes right after the free, where the
                            # ledger counts it gone, not at the next gather on its stream,
                            # which for a step's last units is past the update's temporaries
                            self._reclaim(None)
                    elif ins.kind is Action.RECORD:
                        backend.record(ins.stream, ins.event)
                    else:
                        backend.wait(ins.stream, ins.event)
            except CompileFailed as e:  # the compiler's failure, not the plan's
                raise RunError(str(e)) from None
            except Exception as e:
                raise PlanError(self.plan, k, self.comm.rank, self.step_index, e) from e

    def run_op(self, stream: str, op: Op, keeps: tuple[str, ...] = ()) -> None:
        """Issue `op` on `stream`; `keeps`: the buffers it reads that another stream
        allocated, which the plan says to keep alive on `stream` (ir/effects.py)."""
        kind = op.kind
        if kind is Kind.FREE:
            self.backend.compute(stream, op, lambda: self._free(op))
        elif kind is Kind.STEP:
            self.backend.compute(stream, op, lambda: self._optimizer_step(keeps))
        elif kind.is_collective:
            self._collective(stream, op, keeps)
        elif kind is Kind.RECOMPUTE:
            self.backend.compute(stream, op, lambda: self._recompute(op))
        else:  # a forward or backward written outside the compute stream's fusable runs
            self.compute(Segment(kind, op.mb, (op.target,), -1))

    # -- compute ------------------------------------------------------------------------------

    def compute(self, seg: Segment) -> None:
        op = seg.ops[0] if len(seg.layers) == 1 else seg.ops[-1]
        fn = self._forward if seg.kind is Kind.FWD else self._backward
        # No poll of finished collectives here: a collective is retired (its buffers, FSDP's
        # unsharded gradient and gloo's copy of it, dropped) only where the plan waits for it
        # or a later one on its stream, or at the update, as FSDP2 drops a reduce-scatter's
        # input once its wait completes; retiring whatever had finished by now made the peak
        # depend on timing, which the ledger (passes/memory.py) cannot predict.
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
        with self._autocast(), torch.no_grad() if again else contextlib.nullcontext():
            out = self.regions(first, last)(inp, mb.y if last == "head" else None)
        mb.inp[first], mb.out[last] = inp, out
        if last == "head":
            mb.loss = out.detach()

    def _recompute(self, op: Op) -> None:
        """The forward of a recomputing layer again, from its kept input, now with autograd:
        the same kernels on the same values (no dropout, no randomness in GPT-2's layers),
        so backward reads exactly the activations a plain forward would have saved."""
        mb, layer = self.micro[op.mb], op.target
        with self._autocast():
            out = self.regions(layer, layer)(mb.inp[layer], mb.y if layer == "head" else None)
        mb.out[layer] = out

    def _autocast(self):
        """The compute dtype's autocast around a forward. Backward runs outside it: autograd
        replays each op in the dtype its forward ran in (torch's AMP recipe)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _backward(self, seg: Segment) -> None:
        mb, top, bottom = self.micro[seg.mb], seg.layers[0], seg.layers[-1]
        if self.units:
            key = grad_key(self.spec, seg.mb)
            for unit in {u.name: u for layer in seg.layers for u in self.writes[layer]}.values():
                unit.grad_buffer(key)  # FSDP: the unsharded gradient this backward adds into
        out, inp = mb.out.pop(top), mb.inp.pop(bottom)
        if top == "head":
            torch.autograd.backward(out * self.loss_scale)
        else:
            torch.autograd.backward(out, mb.grad_in.pop(self.layers[self.layers.index(top) + 1]))
        if bottom != self.layers[0]:
            mb.grad_in[bottom] = inp.grad
        if self.units:
            self._measure()
            if self.upcast:  # a unit whose micro-step backward is done folds it (FSDP2)
                for layer in seg.layers:
                    for unit in self.writes[layer]:
                        if self.last_writer[unit.name] == layer:
                            unit.fold(key, self._measure)

    def _free(self, op: Op) -> None:
        """The unit's last use on compute is done; its storage goes back later, by _reclaim.

        Not record_stream: the storage was allocated by a gather on a comm stream, and a block
        freed with record_stream is reusable only once the allocator sees compute pass the
        free, so a host running ahead allocates every new gather afresh and reserved memory
        grows with how far it runs ahead, not with the prefetch window. FSDP2 instead keeps
        the all-gather result referenced with an event recorded after its last use
        (AllGatherState in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) and
        drops it right after the all-gather stream has waited for that event
        (`_wait_all_gather_streams_on_event`, then `all_gather_state = None`), so the next
        gather on that stream reuses the block at once. schedc does the same.
        """
        unit = self.units[op.target]
        unit.drop_grad_views()
        mark = self.backend.mark(COMPUTE)  # after the unit's last use on compute
        self.pending_frees[unit.name] = (mark, self.gathered_on.get(unit.name, COMPUTE))

    def _reclaim(self, stream: str | None, unit: str | None = None) -> None:
        """Give back the storage of freed units that a gather on `stream` could reuse (those
        its stream allocated, and `unit`, about to be gathered again); every one, with None.

        Ordering invariant: the allocating stream waits for the free's mark *before* the
        storage is dropped, so the caching allocator (which reuses a block on the stream that
        allocated it, in stream order) cannot hand it to work that runs before compute is done
        with it."""
        for name, (mark, alloc) in list(self.pending_frees.items()):
            if stream is None or alloc == stream or name == unit:
                if alloc != COMPUTE:
                    self.backend.wait_mark(alloc, mark)
                self.units[name].release()
                del self.pending_frees[name]

    # -- collectives --------------------------------------------------------------------------

    def _collective(self, stream: str, op: Op, keeps: tuple[str, ...] = ()) -> None:
        b = self.backend
        D = self.comm.world  # gradients are averaged over every rank, whatever the mesh
        S = self.spec.mesh.shard
        dim = self.spec.dim_of(op)
        rd = self.reduce_dtype
        if op.kind is Kind.ALLREDUCE and self.units:
            self._replicate(stream, op, dim, keeps)
        elif op.kind is Kind.ALLREDUCE:
            flat = self.buckets[op.target].flat
            self._count(op, flat.numel(), rd)
            held: dict[str, torch.Tensor] = {}

            def launch(pg, flat=flat, held=held):
                if D > 1:
                    flat.div_(D)  # sum of x/D over ranks = the average
                if flat.dtype == rd:
                    return b.all_reduce(flat)(pg)
                # bf16_compress_hook: the bucket's values in the reduce dtype, on this stream
                held["low"] = low = flat.to(rd)
                return b.all_reduce(low)(pg)

            def back(flat=flat, held=held):
                flat.copy_(held.pop("low"))  # the summed average, back into the fp32 bucket

            b.collective(stream, op, launch, None if flat.dtype == rd else back, dim)
        elif op.kind is Kind.ALLGATHER:
            unit = self.units[op.target]
            # every shard of the shard group arrives, in the gather dtype: the full unit
            self._count(op, unit.shard.numel() * S, unit.full.dtype)

            self._reclaim(stream, unit.name)  # freed storage this gather may reuse
            self.gathered_on[unit.name] = stream
            # the op's buffer, allocated on its stream when it is issued (ir/effects.py: a gloo
            # stream may launch the collective later, behind another group's work)
            with b.on(stream):
                full = unit.alloc_full()

            def launch(pg, unit=unit, full=full):
                shard = unit.shard
                if shard.dtype != full.dtype and S > 1:
                    shard = shard.to(full.dtype)  # FSDP2's param_dtype cast, on this stream
                return b.all_gather(full, shard)(pg)  # one rank: the cast into `full` itself

            b.collective(stream, op, launch, None, dim)
            self._measure()
        elif op.kind is Kind.REDUCESCATTER:
            unit = self.units[op.target]
            grad = unit.take_grad(grad_key(self.spec, op.mb))
            keep = grad_buffer(self.spec, unit.name, op.mb) in keeps
            self._count(op, grad.numel(), rd)
            # the step's first reduce-scatter of a unit writes straight into a new gradient
            # shard; later ones (no_sync off) land in a temporary and are added to it, as do
            # all of them when the reduce dtype is not the shard's (the cast back, FSDP2's)
            first = unit.name not in self.scattered
            self.scattered.add(unit.name)
            direct = first and rd == unit.shard.dtype
            # what the op allocates, on its stream when it is issued (ir/effects.py): the new
            # gradient shard at the step's first, and its output unless that is the shard
            with b.on(stream):
                if first:
                    unit.new_shard_grad()
                out = (
                    unit.shard_grad
                    if direct
                    else torch.empty(unit.shard_len, dtype=rd, device=grad.device)
                )
            held: dict[str, torch.Tensor] = {"out": out}

            def launch(pg, grad=grad, held=held, keep=keep):
                if keep:  # written on compute, read on this stream
                    b.keep_alive(grad, stream)
                # the 1/D is applied in the wider of the two dtypes, then the cast (FSDP2's
                # reduce_dtype cast, on this stream); the sum runs in the reduce dtype
                if grad.dtype == rd or grad.element_size() > rd.itemsize:
                    send = grad.div_(D) if D > 1 else grad
                    send = send.to(rd)  # a no-op when the dtypes agree
                else:  # bf16 gradients (bf16 gather) reduced in fp32
                    send = grad.to(rd)
                    if D > 1:
                        send.div_(D)
                return b.reduce_scatter(held["out"], send)(pg)

            def done(unit=unit, held=held, first=first):
                out = held.pop("out")
                if first:  # the first shard of the step, cast back into the fp32 gradient
                    unit.shard_grad.copy_(out)
                else:
                    unit.shard_grad.add_(out)  # accumulate this micro-step's shard (upcast)

            holds = self._holds(unit.name, op.mb, direct)
            if self.spec.hsdp:  # the replicate all-reduce sums `out` first, then lands it
                self.scatter_out[(unit.name, op.mb)] = (held, direct, done)
                b.collective(stream, op, launch, self._released(holds), dim)
            else:
                land = None if direct else done
                b.collective(stream, op, launch, self._released(holds, land), dim)

    def _replicate(self, stream: str, op: Op, dim: str, keeps: tuple[str, ...]) -> None:
        """HSDP: sum a unit's reduce-scattered gradient shard over the replicate group.

        The reduce-scatter already divided by the whole world (each rank's gradient x 1/D,
        summed over the shard group), so the sum over the replicate group is the average
        over every rank. It reads the reduce-scatter's output, which the stream's order
        makes complete first, and then does what the reduce-scatter's completion would have
        done: add (or cast) the shard into the fp32 gradient shard."""
        b, unit = self.backend, self.units[op.target]
        held, direct, done = self.scatter_out.pop((op.target, op.mb))
        self._count(op, unit.shard_len, self.reduce_dtype)

        # allocated on the reduce-scatter's stream: when that is another stream, its block
        # must not go back to it before this all-reduce (and its completion) has read it
        keep = scatter_output(op.target, op.mb) in keeps

        def launch(pg, held=held, keep=keep):
            if keep:
                b.keep_alive(held["out"], stream)
            return b.all_reduce(held["out"])(pg)  # direct: the new gradient shard itself

        # the reduce-scatter's output, a temporary unless direct, goes when this retires
        out = [] if direct or not self.opts.log_buffers else [scatter_output(op.target, op.mb)]
        b.collective(stream, op, launch, self._released(out, None if direct else done), dim)

    def _log(self, action: str, buffer: str) -> None:
        self.buffer_log.append((self.step_index, self.at, action, buffer))

    def _holds(self, unit: str, mb: int, direct: bool) -> list[str]:
        """What a reduce-scatter being issued holds until it is retired (ir/effects.py):
        what it sends, over more than one rank, and its output when that is a temporary."""
        if not self.opts.log_buffers:
            return []
        holds = [f"rs_in[{unit}]@mb{mb}"] if self.spec.mesh.shard > 1 else []
        if not direct:
            holds.append(scatter_output(unit, mb))
        for h in holds:
            self._log("hold", h)
        # HSDP: the output lives on until the replicate all-reduce that reads it retires
        return [h for h in holds if not (self.spec.hsdp and h.startswith("rs_out"))]

    def _released(self, holds: list[str], done=None):
        """`done`, telling the buffer log that the collective's holds went (when logging)."""
        if not holds:
            return done

        def released():
            for h in holds:
                self._log("release", h)
            if done is not None:
                done()

        return released

    def _count(self, op: Op, numel: int, dtype: torch.dtype) -> None:
        """Bytes a collective moves per rank: its buffer's elements in the dtype it moves."""
        key = f"{op.kind.value}[{op.target}]"
        self.comm_bytes[key] = self.comm_bytes.get(key, 0) + numel * dtype.itemsize

    # -- the update ----------------------------------------------------------------------------

    def _optimizer_step(self, keeps: tuple[str, ...] = ()) -> None:
        """The update, enqueued without reading anything on the host (the GPU never idles
        waiting for it): the global norm from the flat gradient buffers, clipping by one
        foreach multiply, and the non-finite check on the device, handed to fused AdamW as
        its `found_inf` (a non-finite loss or norm leaves parameters, moments and step count
        as they were). The step's loss and norm reach the host after it, in `_finish`."""
        spec, opt = self.spec, self.spec.optim
        self.backend.drain()  # every reduction retired: shards and buckets hold final sums
        stats = StepStats(self.step_index, 0.0, opt.lr_at(self.step_index, spec.steps), 0.0, 0, 0)
        if self.units:
            grads = [u.shard_grad for u in self.units.values()]
            # each rank's shards' squared norm, summed over the job; every replica holds the
            # same shards (HSDP), so the sum counts each R times
            sq = torch.stack(torch._foreach_norm(grads)).square().sum()
            if self.comm.world > 1:
                dist.all_reduce(sq, group=self.comm.group)
                if spec.mesh.replicate > 1:
                    sq /= spec.mesh.replicate
            norm = sq.sqrt()
        else:
            grads = [b.flat for b in self.buckets.values()]
            norm = global_grad_norm([p.grad for p in self.params.values()])
        if self.opts.record:
            stats.grads = self.full_tensors(grad=True)
        # the global loss: the mean over every rank's micro-steps
        loss = torch.stack([m.loss for m in self.micro]).double().sum() / spec.accum
        if self.comm.world > 1:
            dist.all_reduce(loss, group=self.comm.group)
            loss /= self.comm.world
        bad = (~(torch.isfinite(loss) & torch.isfinite(norm))).to(torch.float32)
        if opt.clip > 0:
            torch._foreach_mul_(grads, clip_coef(norm, opt.clip))
        for group in self.optimizer.param_groups:
            group["lr"] = stats.lr
        self.optimizer.found_inf = bad  # fused AdamW skips the update where it is 1
        self.optimizer.step()
        stats.issue_ms = (time.perf_counter() - self.t0) * 1e3
        self._release_grads(keeps)
        if self.opts.record:
            stats.params = self.full_tensors(grad=False)
        self.result = stats
        self._update = (loss, norm)

    def _finish(self) -> StepStats:
        """The step's loss and norm on the host, once its update is enqueued (and on a GPU
        after the step's kernels ran): the log's values, and the non-finite verdict that
        every rank reaches alike, since both values are global."""
        stats, (loss, norm) = self.result, self._update
        stats.loss, stats.grad_norm = loss.item(), norm.item()
        if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
            why = self._nonfinite(stats)
            if self.opts.nonfinite != "skip":
                raise RunError(
                    f"{why}; lower the learning rate, or run with --nonfinite skip to skip "
                    "such updates"
                )
            stats.skipped = why  # the update was skipped on the device (found_inf)
        return stats

    def _held_bytes(self) -> int:
        """Bytes of the model states alive between steps, from the tensors themselves:
        parameters (FSDP: shards), DDP's gradient buckets, AdamW's m and v."""
        if self.units:
            held = [u.shard for u in self.units.values()]
        else:
            held = list(self.params.values()) + [b.flat for b in self.buckets.values()]
        held += [
            t
            for st in self.optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        return sum(t.untyped_storage().nbytes() for t in held)

    def _release_grads(self, keeps: tuple[str, ...]) -> None:
        """After the update: measure the model states, then free FSDP's gradient shards."""
        if self.units:
            held = [t for u in self.units.values() for t in (u.shard, u.shard_grad)]
        else:
            held = list(self.params.values()) + [b.flat for b in self.buckets.values()]
        opt_state = [
            t
            for st in self.optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]  # Adam m and v, not the step count
        self.mem["states"] = sum(t.untyped_storage().nbytes() for t in held + opt_state)
        for u in self.units.values():
            if u.shard_grad is not None and shard_grad(u.name) in keeps:
                # allocated on a comm stream by the reduce-scatter, read by compute (norm, clip,
                # AdamW): freed now on the host, its block must wait for compute (FSDP2 keeps
                # the gradient referenced until the next step instead, _fsdp_collectives.py)
                self.backend.keep_alive(u.shard_grad, COMPUTE)
            u.drop_shard_grad()

    def _nonfinite(self, stats: StepStats) -> str:
        """Name the step, and the ranks and micro-steps whose loss was not finite."""
        mine = [(self.comm.rank, j) for j, m in enumerate(self.micro) if not torch.isfinite(m.loss)]
        every = [None] * self.comm.world
        if self.comm.world > 1:
            dist.all_gather_object(every, mine, group=self.comm.group)
        else:
            every = [mine]
        bad = [x for part in every for x in part]
        if bad:
            where = ", ".join(f"rank {r} micro-step {j}" for r, j in bad)
            return f"step {stats.step}: the loss is not finite in {where}"
        return (
            f"step {stats.step}: the gradient norm is {stats.grad_norm} (the loss was "
            f"finite in every micro-step, so a backward produced it)"
        )

    def full_tensors(self, *, grad: bool) -> dict[str, torch.Tensor]:
        """Full gradients or parameters by name (FSDP: gathered from the shards; tests only)."""
        names = {id(p): n for n, p in self.params.items()}
        if not self.units:
            return {n: (p.grad if grad else p).detach().clone() for n, p in self.params.items()}
        out = {}
        for u in self.units.values():
            src = u.shard_grad if grad else u.shard
            # every rank's shard, in rank order: each replica's S shards in turn (HSDP), of
            # which the first replica's are the unit
            full = torch.empty(
                u.padded * self.spec.mesh.replicate, dtype=src.dtype, device=src.device
            )
            if "all_gather_into_tensor" in getattr(self.backend, "fallbacks", ()):
                # gloo on CUDA tensors (ranks sharing a GPU) without the flat form: the list
                dist.all_gather(list(full.chunk(self.comm.world)), src, group=self.comm.group)
            elif self.comm.world > 1:
                dist.all_gather_into_tensor(full, src.contiguous(), group=self.comm.group)
            else:
                full.copy_(src)
            out.update({names[id(p)]: t for p, t in u.assemble(full[: u.padded]).items()})
        return out

    def _measure(self) -> None:
        if not self.opts.measure:
            return
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units.values())
        grads = sum(
            g.numel() * g.element_size()
            for u in self.units.values()
            for g in [*u.grads.values(), *([u.acc] if u.acc is not None else [])]
        )
        self.mem["gathered_peak"] = max(self.mem["gathered_peak"], gathered)
        self.mem["grads_peak"] = max(self.mem["grads_peak"], grads)

    def memory(self) -> dict[str, int]:
        """Bytes schedc held on this rank, measured from the tensors themselves: the model
        states at the last update (parameters, gradients, Adam m and v), and the peaks of
        gathered units and unsharded gradients."""
        return {"states": 0, **self.mem, **self.backend.stats()}

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
        model = init_model(spec.model, spec.seed, self.opts.dtype).to(self.device)
        for attr in ("loss_chunk", "embed_into_grad", "loss_scale"):
            setattr(model, attr, getattr(self.model, attr))
        events += probe_compute(
            model,
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
        return ops + getattr(self, "probe_events", [])


def collective_streams(plan: Plan) -> set[str]:
    """The streams the plan issues collectives on (each is a communicator on a GPU)."""
    return {i.stream for i in plan.instrs if i.kind is Action.RUN and i.op.is_collective}


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

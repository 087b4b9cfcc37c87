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
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from schedc.compiler import Compiled
from schedc.data import load_batches
from schedc.fuse import Segment, fuse
from schedc.ir import COMPUTE, Kind, Op
from schedc.lower import Plan
from schedc.reference import (
    adamw_groups,
    clip_coef,
    format_log,
    global_grad_norm,
    init_model,
    make_adamw,
)
from schedc.resolve import BucketSpec, DDPSpec, FSDPSpec
from schedc.runtime import CPUBackend, CUDABackend, Span
from schedc.shard import Bucket, FlatUnit


class RunError(Exception):
    """A run-time failure with a message for the user (printed on every rank, exit 1)."""


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
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), None, timeout)


@dataclass
class RunOptions:
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0
    trace: bool = False
    dtype: torch.dtype = torch.float32
    record: bool = False  # keep full gradients and parameters of each step (tests)
    log: bool = True


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    dt_ms: float
    tokens_per_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)  # per collective kind, this rank
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


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

    def __init__(self, compiled: Compiled, comm: Comm, options: RunOptions = RunOptions()):
        self.compiled, self.comm, self.opts = compiled, comm, options
        spec = self.spec = compiled.spec
        if comm.world != spec.world:
            raise RunError(f"the schedule is for world {spec.world}, but this job has "
                           f"{comm.world} rank{'s' if comm.world != 1 else ''}")
        self.plan: Plan = compiled.plan(comm.rank)
        self.device = pick_device(options.device)
        self.layers = spec.model.layers
        self.model = init_model(spec.model, spec.seed, options.dtype).to(self.device)
        self.params = dict(self.model.named_parameters())
        self.batches = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size)
        # each micro-batch's mean loss x 1/k (accumulation); the 1/D of averaging is applied
        # to a buffer right before it is summed across ranks (as DDP does), so a buffer that
        # already holds earlier micro-steps' averaged gradients stays correct when summed
        self.loss_scale = 1.0 / spec.accum
        streams = tuple(spec.stream_names())  # every rank builds the same stream groups
        if self.device.type == "cuda":
            self.backend = CUDABackend(streams, comm, options.trace, self.device)
        else:
            self.backend = CPUBackend(streams, comm, options.trace)
        self.buckets: dict[str, Bucket] = {}
        self.units: dict[str, FlatUnit] = {}
        if isinstance(spec.strategy, FSDPSpec):
            self.units = {u.name: FlatUnit(u, spec.model, self.params, comm.rank, comm.world)
                          for u in spec.strategy.units}
            decay, plain = [], []
            for u in self.units.values():
                d, p = u.optimizer_params()
                decay += d
                plain += p
            self.optimizer = adamw_groups(decay, plain, spec.optim)
            writers = {u.name: {w for p in u.params for w in spec.model.writers(p)}
                       for u in spec.strategy.units}
            # the units whose gradients each layer's backward writes into
            self.writes = {layer: [self.units[n] for n, ws in writers.items() if layer in ws]
                           for layer in self.layers}
        else:
            if isinstance(spec.strategy, DDPSpec):
                specs = spec.strategy.buckets
            else:  # one process: a single flat gradient buffer, never communicated
                specs = (BucketSpec("grads", tuple(self.params), None, 0),)
            self.buckets = {b.name: Bucket(b, self.params) for b in specs}
            self.optimizer = make_adamw(self.params.items(), spec.optim)
        # fused runs of compute ops; when tracing every op runs alone, so each gets a span
        self.items = fuse(self.plan, self.layers, enabled=not options.trace)
        self.step_index = 0
        self.mem = {"gathered_peak": 0, "grads_peak": 0}
        self.trace_spans: list[tuple[int, Span]] = []

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> StepStats:
        spec, s = self.spec, self.step_index
        t0 = time.perf_counter()
        self.micro = [
            _Micro(*(t.to(self.device, non_blocking=True) for t in self.batches.micro_batch(
                s, self.comm.rank, j, spec.micro, spec.world)))
            for j in range(spec.accum)
        ]
        for b in self.buckets.values():
            b.flat.zero_()
        for u in self.units.values():
            u.shard_grad.zero_()
        self.comm_bytes: dict[str, int] = {}
        self.result: StepStats | None = None
        self.execute()
        self.backend.synchronize()
        dt = time.perf_counter() - t0
        stats = self.result
        stats.dt_ms = dt * 1e3
        stats.tokens_per_s = spec.tokens_per_step / dt
        stats.comm_bytes = self.comm_bytes
        if self.opts.trace:
            self.trace_spans += [(s, sp) for sp in self.backend.spans]
            self.backend.spans.clear()
        self.step_index += 1
        return stats

    def execute(self) -> None:
        """Issue the plan, item by item; on failure, show where in the plan."""
        backend, instrs = self.backend, self.plan.instrs
        for item in self.items:
            k = item.first if isinstance(item, Segment) else item
            try:
                with _range(item if isinstance(item, Segment) else instrs[item]):
                    if isinstance(item, Segment):
                        self.compute(item)
                        continue
                    ins = instrs[item]
                    if ins.kind == "run":
                        self.run_op(ins.stream, ins.op)
                    elif ins.kind == "record":
                        backend.record(ins.stream, ins.event)
                    else:
                        backend.wait(ins.stream, ins.event)
            except Exception as e:
                raise PlanError(self.plan, k, self.comm.rank, self.step_index, e) from e

    def run_op(self, stream: str, op: Op) -> None:
        kind = op.kind
        if kind is Kind.FREE:
            self.backend.compute(stream, op, lambda: self._free(op))
        elif kind is Kind.STEP:
            self.backend.compute(stream, op, self._optimizer_step)
        elif kind.is_collective:
            self._collective(stream, op)
        else:  # a forward or backward written outside the compute stream's fusable runs
            self.compute(Segment(kind, op.mb, (op.target,), -1))

    # -- compute ------------------------------------------------------------------------------

    def compute(self, seg: Segment) -> None:
        op = seg.ops[0] if len(seg.layers) == 1 else seg.ops[-1]
        fn = self._forward if seg.kind is Kind.FWD else self._backward
        self.backend.compute(COMPUTE, op, lambda: fn(seg))
        if seg.kind is Kind.BWD:
            self.backend.poll()

    def _forward(self, seg: Segment) -> None:
        mb, first, last = self.micro[seg.mb], seg.layers[0], seg.layers[-1]
        i = self.layers.index(first)
        if i == 0:
            inp = mb.x
        else:
            # cut the graph here: what is below runs its backward on its own, later
            inp = mb.out[self.layers[i - 1]].detach().requires_grad_()
        out = self.model.forward_range(first, last, inp, mb.y if last == "head" else None)
        mb.inp[first], mb.out[last] = inp, out
        if last == "head":
            mb.loss = out.detach()

    def _backward(self, seg: Segment) -> None:
        mb, top, bottom = self.micro[seg.mb], seg.layers[0], seg.layers[-1]
        if self.units:
            for layer in seg.layers:
                for unit in self.writes[layer]:
                    unit.grad_buffer()  # FSDP: the unsharded gradient this backward adds into
        out, inp = mb.out.pop(top), mb.inp.pop(bottom)
        if top == "head":
            torch.autograd.backward(out * self.loss_scale)
        else:
            torch.autograd.backward(out, mb.grad_in.pop(self.layers[self.layers.index(top) + 1]))
        if bottom != self.layers[0]:
            mb.grad_in[bottom] = inp.grad
        if self.units:
            self._measure()

    def _free(self, op: Op) -> None:
        unit = self.units[op.target]
        self.backend.keep_alive(unit.full, COMPUTE)  # compute read it; the allocator must wait
        unit.release()

    # -- collectives --------------------------------------------------------------------------

    def _collective(self, stream: str, op: Op) -> None:
        b = self.backend
        D = self.comm.world
        if op.kind is Kind.ALLREDUCE:
            flat = self.buckets[op.target].flat
            self._count(op, flat)
            reduce = b.all_reduce(flat)

            def launch(pg, flat=flat, reduce=reduce):
                if D > 1:
                    flat.div_(D)  # sum of x/D over ranks = the average
                return reduce(pg)

            b.collective(stream, op, launch, None)
        elif op.kind is Kind.ALLGATHER:
            unit = self.units[op.target]
            self._count(op, unit.shard, D)  # every rank's shard arrives: the full unit
            gather = b.all_gather(unit.full, unit.shard)

            def launch(pg, unit=unit, gather=gather):
                unit.alloc_full()  # storage comes back (on the comm stream, on a GPU)
                return gather(pg)

            b.collective(stream, op, launch, None)
            self._measure()
        elif op.kind is Kind.REDUCESCATTER:
            unit = self.units[op.target]
            grad = unit.take_grad()
            self._count(op, grad)
            held: dict[str, torch.Tensor] = {}

            def launch(pg, unit=unit, grad=grad, held=held):
                b.keep_alive(grad, stream)  # written on compute, read on this stream
                if D > 1:
                    grad.div_(D)
                held["out"] = torch.empty_like(unit.shard_grad)  # allocated on this stream
                return b.reduce_scatter(held["out"], grad)(pg)

            def done(unit=unit, grad=grad, held=held):
                unit.shard_grad.add_(held.pop("out"))  # accumulate this micro-step's shard

            b.collective(stream, op, launch, done)

    def _count(self, op: Op, t: torch.Tensor, times: int = 1) -> None:
        """Bytes a collective moves per rank, counted from its real buffer."""
        key = f"{op.kind.value}[{op.target}]"
        self.comm_bytes[key] = self.comm_bytes.get(key, 0) + t.numel() * t.element_size() * times

    # -- the update ----------------------------------------------------------------------------

    def _optimizer_step(self) -> None:
        spec, opt = self.spec, self.spec.optim
        self.backend.drain()  # every reduction retired: shards and buckets hold final sums
        stats = StepStats(self.step_index, 0.0, 0.0, 0.0, 0.0, 0.0)
        if self.units:
            sq = sum((u.shard_grad.double().pow(2).sum() for u in self.units.values()),
                     torch.zeros((), dtype=torch.float64, device=self.device))
            if self.comm.world > 1:
                dist.all_reduce(sq, group=self.comm.group)
            norm = sq.sqrt().to(self.opts.dtype)
            grads = [u.shard_grad for u in self.units.values()]
        else:
            grads = [p.grad for p in self.params.values()]
            norm = global_grad_norm(grads)
        if self.opts.record:
            stats.grads = self.full_tensors(grad=True)
        if opt.clip > 0:
            coef = clip_coef(norm, opt.clip)
            for g in grads:
                g.mul_(coef)
        lr = opt.lr_at(self.step_index, spec.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        loss = torch.stack([m.loss for m in self.micro]).double().sum() / spec.accum
        if self.comm.world > 1:
            dist.all_reduce(loss, group=self.comm.group)
            loss /= self.comm.world
        stats.loss, stats.lr, stats.grad_norm = loss.item(), lr, norm.item()
        if self.opts.record:
            stats.params = self.full_tensors(grad=False)
        self.result = stats

    def full_tensors(self, *, grad: bool) -> dict[str, torch.Tensor]:
        """Full gradients or parameters by name (FSDP: gathered from the shards; tests only)."""
        names = {id(p): n for n, p in self.params.items()}
        if not self.units:
            return {n: (p.grad if grad else p).detach().clone() for n, p in self.params.items()}
        out = {}
        for u in self.units.values():
            src = u.shard_grad if grad else u.shard
            full = torch.empty(u.padded, dtype=src.dtype, device=src.device)
            if self.comm.world > 1:
                dist.all_gather_into_tensor(full, src.contiguous(), group=self.comm.group)
            else:
                full.copy_(src)
            out.update({names[id(p)]: t for p, t in u.assemble(full).items()})
        return out

    def _measure(self) -> None:
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units.values())
        grads = sum(u.grad.numel() * u.grad.element_size() for u in self.units.values()
                    if u.grad is not None)
        self.mem["gathered_peak"] = max(self.mem["gathered_peak"], gathered)
        self.mem["grads_peak"] = max(self.mem["grads_peak"], grads)

    def memory(self) -> dict[str, int]:
        """Bytes of what schedc holds on this rank, measured from the tensors themselves."""
        def nbytes(ts) -> int:
            return sum(t.untyped_storage().nbytes() for t in ts)

        opt_state = [t for st in self.optimizer.state.values() for t in st.values()
                     if torch.is_tensor(t) and t.dim() > 0]  # Adam m and v (not the step count)
        if self.units:
            held = [t for u in self.units.values() for t in (u.shard, u.shard_grad)]
        else:
            held = list(self.params.values()) + [b.flat for b in self.buckets.values()]
        return {"states": nbytes(held) + nbytes(opt_state), **self.mem, **self.backend.stats()}

    def close(self) -> None:
        self.backend.close()

    def trace_events(self) -> list[dict]:
        return chrome_events(self.comm.rank, self.plan.streams, self.trace_spans)


def _range(item):
    """A profiler range named after the op(s), when a profiler is listening (else free)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    if isinstance(item, Segment):
        name = str(item.ops[0]) if len(item.layers) == 1 else (
            f"{item.kind.value}[{item.layers[0]}..{item.layers[-1]}]@mb{item.mb}")
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
        window = ([head] + (["  ..."] if lo else []) + body[lo:hi]
                  + (["  ..."] if hi < len(body) else []))
        cause_text = "".join(traceback.format_exception_only(type(cause), cause)).strip()
        super().__init__(f"rank {rank}, step {step}: instruction {index} "
                         f"({plan.instrs[index]}) failed: {cause_text}\n" + "\n".join(window))


# -- traces ---------------------------------------------------------------------------------------


def chrome_events(rank: int, streams, spans: list[tuple[int, Span]]) -> list[dict]:
    """Chrome/Perfetto trace events: one process per rank, one thread per stream."""
    tid = {s: i for i, s in enumerate(streams)}
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    for s, i in tid.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": i,
                       "args": {"name": s}})
    for step, sp in spans:
        ev = {"name": str(sp.op), "ph": "X", "pid": rank, "tid": tid[sp.stream],
              "ts": sp.start / 1e3, "dur": max(0.0, (sp.end - sp.start) / 1e3),
              "cat": "collective" if sp.op.is_collective else "compute",
              "args": {"step": step, "stream": sp.stream}}
        if sp.op.is_collective:
            ev["args"]["launch_us"] = sp.issue / 1e3
            ev["args"]["complete_us"] = sp.end / 1e3
        events.append(ev)
    return events


# -- the `run` verb --------------------------------------------------------------------------------


def agree_at_startup(compiled: Compiled, comm: Comm, plan: Plan) -> None:
    """Every rank compiled the same schedule into the same collective order, or none starts."""
    mine = {
        "rank": comm.rank,
        "schedule": hashlib.sha256(compiled.source.text.encode()).hexdigest()[:16],
        "path": compiled.source.path,
        "collectives": plan.collective_digest(),
        "world": compiled.spec.world,
        "steps": compiled.spec.steps,
        "model": compiled.spec.model_name,
    }
    everyone: list[dict] = [None] * comm.world
    dist.all_gather_object(everyone, mine, group=comm.group)
    base = everyone[0]
    for other in everyone[1:]:
        diff = [k for k in ("schedule", "collectives", "world", "steps", "model")
                if other[k] != base[k]]
        if diff:
            what = ", ".join(f"{k} {base[k]} vs {other[k]}" for k in diff)
            raise RunError(f"ranks disagree before step 1: rank 0 compiled {base['path']} and "
                           f"rank {other['rank']} compiled {other['path']} ({what}); every "
                           "rank must run the same schedule")


def run_main(compiled: Compiled, opts: RunOptions, trace_path: str | None) -> int:
    """Train for spec.steps steps under torchrun (or alone, at world 1)."""
    device = pick_device(opts.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    spec = compiled.spec
    if world_env != spec.world:
        how = (f"torchrun --standalone --nproc_per_node={spec.world} -m schedc run "
               f"{compiled.source.path}")
        raise RunError(f"{compiled.source.path} is a world-{spec.world} schedule, but this job "
                       f"has {world_env} rank{'s' if world_env != 1 else ''}; run: {how}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    comm = Comm.from_env(backend, opts.timeout_s)
    try:
        # agree first: building the executor creates a process group per stream, which would
        # wait forever for a rank whose schedule has other streams
        agree_at_startup(compiled, comm, compiled.plan(comm.rank))
        ex = Executor(compiled, comm, opts)
        if comm.rank == 0 and opts.log:
            print(f"schedc: {compiled.source.path}: {spec.kind}, world {spec.world}, "
                  f"{spec.accum} micro-step(s) of {spec.micro} x {spec.seq_len}, "
                  f"{spec.steps} steps on {device.type} "
                  f"({torch.get_num_threads()} thread(s) per rank)", flush=True)
        for _ in range(spec.steps):
            st = ex.step()
            if comm.rank == 0 and opts.log:
                print(format_log(st.step, st.loss, st.lr, st.grad_norm, st.dt_ms,
                                 st.tokens_per_s), flush=True)
        ex.close()
        if trace_path:
            write_trace(trace_path, ex, comm)
        if comm.rank == 0 and opts.log:
            report_memory(compiled, ex)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def write_trace(path: str, ex: Executor, comm: Comm) -> None:
    import json

    mine = ex.trace_events()
    if comm.world > 1:
        every: list = [None] * comm.world
        dist.all_gather_object(every, mine, group=comm.group)
        events = [e for part in every for e in part]
    else:
        events = mine
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"schedule": ex.compiled.source.path}}, f)
        print(f"schedc: trace written to {path} ({len(events)} events)", flush=True)


def report_memory(compiled: Compiled, ex: Executor) -> None:
    from schedc.check import fmt_bytes

    pred, meas = compiled.memory, ex.memory()
    rows = [("model states", pred.states, meas["states"]),
            ("gathered units (peak)", pred.gathered_peak, meas["gathered_peak"]),
            ("unsharded grads (peak)", pred.grads_peak, meas["grads_peak"])]
    text = "; ".join(f"{name} {fmt_bytes(p)} predicted, {fmt_bytes(m)} measured"
                     for name, p, m in rows if p or m)
    if "cuda_max_allocated" in meas:
        text += f"; cuda max allocated {fmt_bytes(meas['cuda_max_allocated'])}"
    print(f"schedc: memory per rank: {text}", file=sys.stderr, flush=True)


def add_run_args(p) -> None:
    p.add_argument("file", nargs="?", help="the schedule (default: the bundled "
                   "tiny_ddp_overlap.sched)")
    p.add_argument("--model", help="model size (overrides the file)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides the file)")
    p.add_argument("--seed", type=int, help="seed (overrides the file)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds any rank waits for the others before failing (default 300)")


def run_command(args) -> int:
    from schedc.commands import overrides
    from schedc.compiler import compile_file
    from schedc.resources import default_schedule

    path = args.file or str(default_schedule())
    compiled = compile_file(path, overrides(args))
    opts = RunOptions(device=args.device, timeout_s=args.timeout, trace=bool(args.trace))
    try:
        return run_main(compiled, opts, args.trace)
    except RunError as e:
        rank = os.environ.get("RANK", "0")
        print(f"schedc: error on rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1

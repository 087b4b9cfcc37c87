"""Per-rank memory predicted from the plan, by walking its issue order.

What schedc itself allocates, each buffer in its own dtype (`spec.numerics`; the
executor, schedc/exec/executor.py and exec/flat.py, allocates exactly these):

* model states, fp32 always: parameter, gradient, Adam m and v. DDP and one process keep
  all of them on every rank (16 bytes/param; the DDP bucket is the gradient); FSDP keeps
  each unit's shard (16 bytes/param / D, after padding the unit to a multiple of D, D the
  mesh's shard size: the world, or under HSDP the shard group's ranks), its
  gradient shard only from the unit's first reduce-scatter of the step to the update (as
  FSDP2 does). The compute dtype does not change them: autocast casts on the fly.
* gathered units (FSDP): a unit's full flat parameter in the gather dtype (FSDP2's
  param_dtype: bf16 halves it), from its all-gather to its free.
* unsharded gradients (FSDP): a unit's full flat gradient in the gather dtype (autograd
  writes a parameter's gradient in the parameter's dtype), per micro-step (one for the
  whole step under no_sync), from the first backward that writes it until the
  reduce-scatter that consumes it is issued: the executor hands it to the collective
  (exec/flat.py `take_grad`), and from then on what the collective holds (below) lives until
  it is retired. The executor retires a stream's collectives in order when a wait reaches
  one of them, and all before the update, nowhere else (exec/cpu_backend.py `wait`, `drain`: a
  point the plan names, as FSDP2 drops a reduce-scatter's input when its wait completes;
  on CUDA the caching allocator may reuse the buffer sooner: there the count is an upper
  bound). Under no_sync with a reduce dtype wider than the gather dtype (bf16 gather,
  fp32 reduce) the micro-steps accumulate in the reduce dtype, as FSDP2 upcasts them
  (`FSDPParam.to_accumulated_grad_if_needed`): each micro-step's gradient in the gather
  dtype lives until the backward of the unit's last writer (its lowest layer), which folds
  it into a reduce-dtype accumulator (created by the first fold, both live at that
  moment); the reduce-scatter then takes the accumulator itself, with no cast.
* communication buffers: the temporaries of a collective, in bytes; an all-gather's and an
  all-reduce's live at its op in the issue order and are released after it (a stream runs
  its collectives one at a time); a reduce-scatter holds what it sends, P x r, until it is
  retired: gloo's copy of the unsharded gradient or its cast (`_reduce_scatter_base`
  copies its input and keeps the copy until its work is released; measured: the input's
  bytes, held after the collective completed; NCCL makes none, so on CUDA this is an upper
  bound), and its output shard when that is a temporary (below) until it is added into the
  fp32 one at retirement. A group of one rank communicates nothing: its all-gather casts
  the shard straight into the gathered buffer and its reduce-scatter copies (or casts) the
  gradient into the output when issued, so it holds no input afterwards:

    all-gather      gather not fp32, D > 1: the shard cast to the gather dtype, S x g
                    (FSDP2's copy-in of `_sharded_param_data` into a param_dtype buffer)
    reduce-scatter  reduce != gather: the unsharded gradient cast to the reduce dtype,
                    P x r (FSDP2's `reduce_scatter_input`, allocated in reduce_dtype; FSDP2
                    copies into it even when the dtypes agree, schedc's flat gradient
                    already is that buffer then): a temporary of the op (gloo holds its
                    copy in a larger group);
                    the output, S x r, unless it is the unit's first of the step and the
                    reduce dtype is fp32 (then it lands in the new fp32 gradient shard);
                    after any other first one, the output is cast back into the new fp32
                    gradient shard, S x 4 (FSDP2's `_to_dtype_if_needed(reduce_output,
                    orig_dtype)`), which the states count from then on
    all-reduce      HSDP: the reduce-scatter's output shard is all-reduced in place over the
                    replicate group, so it brings no buffer of its own;
                    DDP, reduce not fp32: the bucket cast to the reduce dtype, n x r, summed
                    and copied back into the fp32 bucket (DDP's bf16_compress_hook:
                    `buffer.to(bf16).div_(D)`, all-reduce, `buffer.copy_(result)`)

  with P the unit's padded length, S = P / D its shard, n a bucket's length, g and r the
  gather and reduce dtypes' bytes. The unsharded gradient is still live during its
  reduce-scatter (the collective reads it), so the peak counts both.

Communication volume (`op_bytes`) follows the same dtypes: an all-gather moves P x g
bytes, a reduce-scatter P x r, an all-reduce n x r (HSDP's of a unit: S x r), per rank
over the collective's mesh dimension (`traffic` sums them per dimension; the executor's
`StepStats.comm_bytes` counts the same from its buffers).

* the update allocates nothing of size: the global norm is one norm per gradient tensor
  (`torch._foreach_norm`), clipping multiplies in place, and fused AdamW updates in place
  (measured on a CPU: 0.0002 bytes a parameter, against foreach AdamW's 4 for sqrt(v)).
* activations: what autograd saves per layer per micro-step, derived in
  `layer_acts` from GPT-2's ops at the model's shapes, micro size and compute dtype;
  added at each fwd (a recomputing layer adds only its input), added back at its
  recompute and released at its bwd, with each op's transient on top while it runs.

The peak is taken over the plan's issue order of the sum of all of these, and is what the
`memory` budget is checked against. The executor measures the states, gathered and
unsharded-gradient peaks from its own buffers, and on a CPU the whole peak as live heap
(schedc/exec/heap.py), so each can be compared with its prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.effects import Alloc, Free, Lifetimes, Part, Step, lifetimes
from schedc.ir.plan import Plan
from schedc.ir.sizes import op_bytes
from schedc.ir.spec import Spec


@dataclass(frozen=True)
class MemoryReport:
    states: int  # parameters, gradients and optimizer state on this rank (fp32)
    gathered_peak: int  # the most full-size unit parameters live at once (gather dtype)
    grads_peak: int  # the most unsharded unit gradients live at once (gather dtype)
    comm_peak: int  # the most collective temporaries live at once (casts, outputs)
    peak: int  # the peak of the total, activations included, along the issue order
    peak_at: str  # the op at which the peak is reached
    activations: int  # the most activation bytes live at once (saved, kept, transient)
    buffers_peak: int = 0  # the peak without activations (states, units, grads, comm)
    parts: tuple[tuple[str, int], ...] = ()  # what the peak is made of, largest first
    # the peak at op boundaries: without an op's own transients (its activation scratch and
    # the optimizer's temporaries), which live only inside the op
    settled_peak: int = 0

    @property
    def largest(self) -> str:
        """The largest contributor to the peak, in words."""
        return self.parts[0][0] if self.parts else "model states"

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("model states", self.states),
            ("gathered units (peak)", self.gathered_peak),
            ("unsharded grads (peak)", self.grads_peak),
            ("comm buffers (peak)", self.comm_peak),
            ("activations (peak)", self.activations),
            ("total (peak)", self.peak),
        ]


class Ledger:
    """The interpreter of a plan's lifetimes (ir/effects.py) with byte sizes: what is live
    at each measure, the peaks of each part, and the largest total and what it is made of.
    A pipeline rank's walk (passes/pipeline_memory.py) adds its buffers up with it too."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[Part, int]] = {}
        self.by_part = dict.fromkeys(Part, 0)
        self.peaks = [0, 0, 0, 0]  # gathered, grads, comm, activations
        self.peak: tuple[int, str, tuple] = (0, "", ())
        self.buffers = 0
        self.settled = 0

    def run(self, life: Lifetimes, plan: Plan) -> None:
        for step in life.before:
            self.apply(step, "")
        for ins, steps in zip(plan.instrs, life.steps):
            for step in steps:
                self.apply(step, str(ins.op) if ins.op else "")

    def apply(self, step: Step, at: str) -> None:
        if isinstance(step, Alloc):
            self.live[step.buffer] = (step.part, step.nbytes)
            self.by_part[step.part] += step.nbytes
        elif isinstance(step, Free):
            part, n = self.live.pop(step.buffer)
            self.by_part[part] -= n
        else:
            self.measure(at, step.comm, step.acts)

    def measure(self, at: str, comm: int, transient: int) -> None:
        """`comm` and `transient`: what the op holds only while it runs (casts, outputs;
        activation scratch), on top of what lives."""
        part = self.by_part
        live, held = part[Part.ACTS], comm + part[Part.COMM]
        self.peaks = [
            max(self.peaks[0], part[Part.GATHERED]),
            max(self.peaks[1], part[Part.GRADS]),
            max(self.peaks[2], held),
            max(self.peaks[3], live + transient),
        ]
        buffers = part[Part.STATES] + part[Part.GATHERED] + part[Part.GRADS] + held
        self.buffers = max(self.buffers, buffers)
        self.settled = max(self.settled, buffers - comm + live)
        total = buffers + live + transient
        if total > self.peak[0]:
            parts = (
                (Part.STATES.value, part[Part.STATES]),
                (Part.GATHERED.value, part[Part.GATHERED]),
                (Part.GRADS.value, part[Part.GRADS]),
                (Part.COMM.value, held),
                (Part.ACTS.value, live + transient),
            )
            self.peak = (total, at, parts)

    def report(self, states: int) -> MemoryReport:
        total, at, parts = self.peak
        parts = tuple(sorted(((n, v) for n, v in parts if v), key=lambda p: -p[1]))
        g, gr, c, a = self.peaks
        return MemoryReport(states, g, gr, c, total, at, a, self.buffers, parts, self.settled)


def predict(spec: Spec, plan: Plan) -> MemoryReport:
    """The memory of one rank's plan: its lifetimes (ir/effects.py) added up."""
    life = lifetimes(spec, plan)
    led = Ledger()
    led.run(life, plan)
    return led.report(life.states)


def activation_peak(spec: Spec, plan: Plan) -> int:
    """The most activation bytes live at once along the plan."""
    return predict(spec, plan).activations


def traffic(spec: Spec, plan: Plan) -> dict[str, dict[str, int]]:
    """Bytes a rank moves in one step, per mesh dimension and per collective kind."""
    out: dict[str, dict[str, int]] = {}
    for op in plan.collectives():
        per = out.setdefault(spec.dim_of(op), {})
        per[op.kind.value] = per.get(op.kind.value, 0) + op_bytes(spec, op)
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"

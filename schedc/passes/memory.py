"""Per-rank memory predicted from the plan, by walking its issue order.

What schedc itself allocates, in fp32 bytes:

* model states: parameter, gradient, Adam m and v. DDP keeps all of them on every rank
  (16 bytes/param); FSDP keeps each unit's shard (16 bytes/param / D, after padding the
  unit to a multiple of D), its gradient shard only from the unit's first reduce-scatter
  of the step to the update (as FSDP2 does).
* gathered units (FSDP): a unit's full flat parameter, from its all-gather to its free.
* unsharded gradients (FSDP): a unit's full flat gradient per micro-step (one for the
  whole step under no_sync), from the first backward that writes it to the
  reduce-scatter that consumes it.
* communication buffers (FSDP): the shard-sized temporary of each reduce-scatter in
  flight after a unit's first of the step (the first writes into the gradient shard).

Activations are estimated separately (one micro-step's worth) and are not part of the
budget: they depend on kernels schedc does not choose. The executor measures the same
quantities from its own buffers, so the two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.op import Kind, Op
from schedc.ir.plan import Plan
from schedc.ir.spec import Spec, Strategy, UnitSpec
from schedc.model.arch import FP32


@dataclass(frozen=True)
class MemoryReport:
    states: int  # parameters, gradients and optimizer state on this rank
    gathered_peak: int  # the most full-size unit parameters live at once
    grads_peak: int  # the most unsharded unit gradients live at once
    comm_peak: int  # the most reduce-scatter outputs live at once
    peak: int  # the peak of the total, along the issue order
    peak_at: str  # the op after which the peak is reached
    activations: int  # estimate for one micro-step, outside the budget

    def rows(self) -> list[tuple[str, int]]:
        return [("model states", self.states), ("gathered units (peak)", self.gathered_peak),
                ("unsharded grads (peak)", self.grads_peak), ("comm buffers (peak)", self.comm_peak),
                ("total (peak)", self.peak), ("activations (estimate)", self.activations)]


def padded(numel: int, world: int) -> int:
    """A unit's flat length: numel rounded up to a multiple of the world size."""
    return -(-numel // world) * world


def unit_numel(spec: Spec, unit: UnitSpec) -> int:
    return sum(spec.model.param(p).numel for p in unit.params)


def predict(spec: Spec, plan: Plan) -> MemoryReport:
    acts = activation_estimate(spec)
    if spec.kind is not Strategy.FSDP:
        states = 4 * FP32 * spec.model.numel
        return MemoryReport(states, 0, 0, 0, states, "", acts)
    fs, D = spec.strategy, spec.world
    full = {u.name: padded(unit_numel(spec, u), D) * FP32 for u in fs.units}
    states = sum(4 * (b // D) for b in full.values())
    # between steps a rank holds its parameter shard and Adam m, v; each gradient shard
    # exists from the unit's first reduce-scatter of the step until the update
    held = sum(3 * (b // D) for b in full.values())
    writers = {u.name: {w for p in u.params for w in spec.model.writers(p)} for u in fs.units}

    gathered = grads = comm = 0
    peak = (held, "")
    peaks = [0, 0, 0]
    grad_live: set[tuple[str, int]] = set()  # (unit, micro-step or 0 under no_sync)
    scattered: set[str] = set()  # units reduce-scattered so far in the step
    key = (lambda mb: 0) if fs.no_sync else (lambda mb: mb)
    for op in plan.ops:
        if op.kind is Kind.ALLGATHER:
            gathered += full[op.target]
        elif op.kind is Kind.FREE:
            gathered -= full[op.target]
        elif op.kind is Kind.BWD:
            for u in fs.units:
                live = (u.name, key(op.mb))
                if op.target in writers[u.name] and live not in grad_live:
                    grad_live.add(live)
                    grads += full[u.name]
        elif op.kind is Kind.REDUCESCATTER and op.target in scattered:
            comm += full[op.target] // D  # a temporary; the first lands in the shard itself
        elif op.kind is Kind.REDUCESCATTER:
            held += full[op.target] // D  # the gradient shard comes into being
        peaks = [max(peaks[0], gathered), max(peaks[1], grads), max(peaks[2], comm)]
        total = held + gathered + grads + comm
        if total > peak[0]:
            peak = (total, str(op))
        if op.kind is Kind.REDUCESCATTER:
            # the unsharded gradient and the output are released once the reduction is done
            if op.target in scattered:
                comm -= full[op.target] // D
            scattered.add(op.target)
            live = (op.target, key(op.mb))
            if live in grad_live:
                grad_live.discard(live)
                grads -= full[op.target]
    return MemoryReport(states, peaks[0], peaks[1], peaks[2], peak[0], peak[1], acts)


def activation_estimate(spec: Spec) -> int:
    """Bytes saved for backward by one micro-step, fp32 (a rough, documented estimate).

    Per block and token: about 34 C values (inputs of the LayerNorms, the qkv projection,
    attention output, MLP input and GELU input, x4 for the 4C hidden) plus the attention
    probabilities when the kernel materializes them (n_head x T); the head keeps the
    logits and their gradient (2 V per token).
    """
    cfg, tokens = spec.model, spec.micro * spec.seq_len
    per_block = tokens * (34 * cfg.n_embd) * FP32
    head = tokens * 2 * cfg.vocab_size * FP32
    return cfg.n_layer * per_block + head


def op_bytes(spec: Spec, op: Op) -> int:
    """Bytes one collective moves per rank (its input), for counting communication volume."""
    if op.kind is Kind.ALLREDUCE:
        b = next(b for b in spec.strategy.buckets if b.name == op.target)
        return b.nbytes
    if op.kind in (Kind.ALLGATHER, Kind.REDUCESCATTER):
        u = next(u for u in spec.strategy.units if u.name == op.target)
        return padded(unit_numel(spec, u), spec.world) * FP32
    return 0


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"

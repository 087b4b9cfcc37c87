"""Per-rank memory predicted from the plan, by walking its issue order.

What schedc itself allocates, each buffer in its own dtype (`spec.numerics`; the issue-13
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
  whole step under no_sync), from the first backward that writes it to the reduce-scatter
  that consumes it.
* communication buffers: the temporaries of one collective, live at its op in the issue
  order and released after it (a stream runs its collectives one at a time), in bytes:

    all-gather      gather not fp32: the shard cast to the gather dtype, S x g (FSDP2's
                    copy-in of `_sharded_param_data` into a param_dtype buffer)
    reduce-scatter  reduce != gather: the unsharded gradient cast to the reduce dtype,
                    P x r (FSDP2's `reduce_scatter_input`, allocated in reduce_dtype; FSDP2
                    copies into it even when the dtypes agree, schedc's flat gradient
                    already is that buffer then);
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

Activations are estimated separately (one micro-step's worth, in the compute dtype) and
are not part of the budget: they depend on kernels schedc does not choose. The executor
measures the states, gathered and unsharded-gradient peaks from its own buffers, so the
two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.op import Kind, Op
from schedc.ir.plan import Plan
from schedc.ir.spec import Spec, Strategy, UnitSpec
from schedc.model.arch import FP32


@dataclass(frozen=True)
class MemoryReport:
    states: int  # parameters, gradients and optimizer state on this rank (fp32)
    gathered_peak: int  # the most full-size unit parameters live at once (gather dtype)
    grads_peak: int  # the most unsharded unit gradients live at once (gather dtype)
    comm_peak: int  # the most collective temporaries live at once (casts, outputs)
    peak: int  # the peak of the total, along the issue order
    peak_at: str  # the op after which the peak is reached
    activations: int  # estimate for one micro-step, outside the budget

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("model states", self.states),
            ("gathered units (peak)", self.gathered_peak),
            ("unsharded grads (peak)", self.grads_peak),
            ("comm buffers (peak)", self.comm_peak),
            ("total (peak)", self.peak),
            ("activations (estimate)", self.activations),
        ]


def padded(numel: int, world: int) -> int:
    """A unit's flat length: numel rounded up to a multiple of the world size."""
    return -(-numel // world) * world


def unit_numel(spec: Spec, unit: UnitSpec) -> int:
    return sum(spec.model.param(p).numel for p in unit.params)


def bucket_numel(spec: Spec, name: str) -> int:
    b = next(b for b in spec.strategy.buckets if b.name == name)
    return sum(spec.model.param(p).numel for p in b.params)


def predict(spec: Spec, plan: Plan) -> MemoryReport:
    acts = activation_estimate(spec)
    r = spec.numerics.reduce.nbytes
    if spec.kind is not Strategy.FSDP:
        states = 4 * FP32 * spec.model.numel
        peak, comm = (states, ""), 0
        if spec.kind is Strategy.DDP and r != FP32:  # bf16_compress_hook's cast of a bucket
            for op in plan.ops:
                if op.kind is Kind.ALLREDUCE:
                    temp = bucket_numel(spec, op.target) * r
                    comm = max(comm, temp)
                    if states + temp > peak[0]:
                        peak = (states + temp, str(op))
        return MemoryReport(states, 0, 0, comm, peak[0], peak[1], acts)
    fs, D = spec.strategy, spec.mesh.shard  # units shard over the shard dimension only
    g = spec.numerics.gather.nbytes
    numel = {u.name: padded(unit_numel(spec, u), D) for u in fs.units}  # P, per unit
    states = sum(4 * FP32 * (n // D) for n in numel.values())
    # between steps a rank holds its parameter shard and Adam m, v; each gradient shard
    # exists from the unit's first reduce-scatter of the step until the update
    held = sum(3 * FP32 * (n // D) for n in numel.values())
    writers = {u.name: spec.writers(u.params) for u in fs.units}

    gathered = grads = 0
    peak = (held, "")
    peaks = [0, 0, 0]
    grad_live: set[tuple[str, int]] = set()  # (unit, micro-step or 0 under no_sync)
    scattered: set[str] = set()  # units reduce-scattered so far in the step
    key = (lambda mb: 0) if fs.no_sync else (lambda mb: mb)
    for op in plan.ops:
        comm = 0  # this op's temporaries (see the module's docstring)
        if op.kind is Kind.ALLGATHER:
            gathered += numel[op.target] * g
            if g != FP32:
                comm = numel[op.target] // D * g  # the shard, cast for the gather
        elif op.kind is Kind.FREE:
            gathered -= numel[op.target] * g
        elif op.kind is Kind.BWD:
            for u in fs.units:
                live = (u.name, key(op.mb))
                if op.target in writers[u.name] and live not in grad_live:
                    grad_live.add(live)
                    grads += numel[u.name] * g
        elif op.kind is Kind.REDUCESCATTER:
            n, first = numel[op.target], op.target not in scattered
            if r != g:
                comm += n * r  # the unsharded gradient, cast to the reduce dtype
            if not (first and r == FP32):
                comm += n // D * r  # the output shard, added (or cast back) into the fp32 one
            if first:
                held += n // D * FP32  # the gradient shard comes into being
        peaks = [max(peaks[0], gathered), max(peaks[1], grads), max(peaks[2], comm)]
        total = held + gathered + grads + comm
        if total > peak[0]:
            peak = (total, str(op))
        if op.kind is Kind.REDUCESCATTER:
            # the unsharded gradient and the temporaries are released once it is done
            scattered.add(op.target)
            live = (op.target, key(op.mb))
            if live in grad_live:
                grad_live.discard(live)
                grads -= numel[op.target] * g
    return MemoryReport(states, peaks[0], peaks[1], peaks[2], peak[0], peak[1], acts)


def activation_estimate(spec: Spec) -> int:
    """Bytes saved for backward by one micro-step (a rough, documented estimate).

    Per block and token: about 34 C values (inputs of the LayerNorms, the qkv projection,
    attention output, MLP input and GELU input, x4 for the 4C hidden) plus the attention
    probabilities when the kernel materializes them (n_head x T), in the compute dtype
    (autocast saves the bf16 copies its matmuls read); the head keeps the logits and their
    gradient (2 V per token) in fp32, since autocast runs the cross-entropy in fp32.
    """
    cfg, tokens = spec.model, spec.micro * spec.seq_len
    per_block = tokens * (34 * cfg.n_embd) * spec.numerics.compute.nbytes
    head = tokens * 2 * cfg.vocab_size * FP32
    return cfg.n_layer * per_block + head


def op_bytes(spec: Spec, op: Op) -> int:
    """Bytes one collective moves per rank (its input), for counting communication volume:
    an all-reduce its bucket in the reduce dtype, an all-gather the full unit in the gather
    dtype, a reduce-scatter the full unit's gradient in the reduce dtype."""
    num = spec.numerics
    if op.kind is Kind.ALLREDUCE and spec.kind is Strategy.DDP:
        return bucket_numel(spec, op.target) * num.reduce.nbytes
    if op.is_collective:
        u = next(u for u in spec.strategy.units if u.name == op.target)
        S = spec.mesh.shard
        dtype = num.gather if op.kind is Kind.ALLGATHER else num.reduce
        full = padded(unit_numel(spec, u), S) * dtype.nbytes
        return full // S if op.kind is Kind.ALLREDUCE else full  # HSDP: the shard
    return 0


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

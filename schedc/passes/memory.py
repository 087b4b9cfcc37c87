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
  one of them, and all before the update, nowhere else (exec/backends.py `wait`, `drain`: a
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
* activations (issue 16): what autograd saves per layer per micro-step, derived in
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

from schedc.ir.op import COMPUTE, Kind, Op
from schedc.ir.plan import Action, Plan
from schedc.ir.spec import Dtype, Spec, Strategy, UnitSpec
from schedc.model.arch import FP32


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


def padded(numel: int, world: int) -> int:
    """A unit's flat length: numel rounded up to a multiple of the world size."""
    return -(-numel // world) * world


def unit_numel(spec: Spec, unit: UnitSpec) -> int:
    return sum(spec.model.param(p).numel for p in unit.params)


def bucket_numel(spec: Spec, name: str) -> int:
    b = next(b for b in spec.strategy.buckets if b.name == name)
    return sum(spec.model.param(p).numel for p in b.params)


class _Ledger:
    """The walk along the issue order: what is live after each op, the peak and its parts."""

    def __init__(self, spec: Spec, held: int):
        self.held, self.gathered, self.grads = held, 0, 0
        self.pending = 0  # buffers of collectives issued and not yet retired
        self.acts = Activations(spec)
        self.peaks = [0, 0, 0, 0]  # gathered, grads, comm, activations
        self.peak: tuple[int, str, tuple] = (held + self.acts.live, "", ())
        self.buffers = held
        self.settled = held + self.acts.live

    def at(self, op: Op, comm: int = 0, optimizer: int = 0) -> None:
        """Account `op`: its activations (saved, kept, transient) with its temporaries."""
        live, transient = self.acts.step(op)
        self._account(str(op), comm, live, transient, optimizer)

    def settle(self, at: str) -> None:
        """Account a moment between ops (no op's transient): buffers changed after `at`."""
        self._account(at, 0, self.acts.live, 0, 0)

    def _account(self, at: str, comm: int, live: int, transient: int, optimizer: int) -> None:
        self.peaks = [
            max(self.peaks[0], self.gathered),
            max(self.peaks[1], self.grads),
            max(self.peaks[2], comm + self.pending),
            max(self.peaks[3], live + transient),
        ]
        buffers = self.held + self.gathered + self.grads + comm + self.pending
        self.buffers = max(self.buffers, buffers)
        self.settled = max(self.settled, buffers - comm + live)
        total = buffers + live + transient + optimizer
        if total > self.peak[0]:
            parts = (
                ("model states", self.held),
                ("gathered units", self.gathered),
                ("unsharded gradients", self.grads),
                ("communication buffers", comm + self.pending),
                ("activations", live + transient),
                ("optimizer temporaries", optimizer),
            )
            self.peak = (total, at, parts)

    def report(self, states: int) -> MemoryReport:
        total, at, parts = self.peak
        parts = tuple(sorted(((n, v) for n, v in parts if v), key=lambda p: -p[1]))
        g, gr, c, a = self.peaks
        return MemoryReport(states, g, gr, c, total, at, a, self.buffers, parts, self.settled)


def predict(spec: Spec, plan: Plan) -> MemoryReport:
    r = spec.numerics.reduce.nbytes
    if spec.kind is not Strategy.FSDP:
        states = 4 * FP32 * spec.model.numel
        led = _Ledger(spec, states)
        for op in plan.ops:
            comm = 0
            if spec.kind is Strategy.DDP and r != FP32 and op.kind is Kind.ALLREDUCE:
                comm = bucket_numel(spec, op.target) * r  # bf16_compress_hook's cast
            led.at(op, comm, 0)  # the update allocates nothing (fused AdamW, foreach norms)
        return led.report(states)
    fs, D = spec.strategy, spec.mesh.shard  # units shard over the shard dimension only
    g = spec.numerics.gather.nbytes
    numel = {u.name: padded(unit_numel(spec, u), D) for u in fs.units}  # P, per unit
    states = sum(4 * FP32 * (n // D) for n in numel.values())
    # between steps a rank holds its parameter shard and Adam m, v; each gradient shard
    # exists from the unit's first reduce-scatter of the step until the update
    led = _Ledger(spec, sum(3 * FP32 * (n // D) for n in numel.values()))
    writers = {u.name: spec.writers(u.params) for u in fs.units}
    # no_sync with a reduce dtype wider than the gather dtype: FSDP2's upcast (see the
    # module's docstring); the micro-step's gradient folds into the accumulator at the
    # backward of the unit's last writer (the lowest layer), keyed "acc"
    upcast = fs.no_sync and r > g
    last_writer = {u: min(ws, key=spec.model.layer_index) for u, ws in writers.items()}
    # unsharded gradients live: (unit, micro-step, 0 under no_sync, or "acc") -> bytes
    grad_live: dict[tuple[str, object], int] = {}
    scattered: set[str] = set()  # units reduce-scattered so far in the step
    key = (lambda mb: 0) if fs.no_sync and not upcast else (lambda mb: mb)
    # reduce-scatters issued but not yet retired: stream -> [(issue index, bytes they hold)]
    retiring: dict[str, list[tuple[int, int]]] = {}
    stream_of = {ins.op: ins.stream for ins in plan.instrs if ins.kind is Action.RUN}
    issued = {op: i for i, op in enumerate(plan.ops)}

    def retire(stream: str | None, upto: int | None) -> None:
        for s in [stream] if stream is not None else list(retiring):
            keep = []
            for i, held in retiring.get(s, []):
                if upto is None or i <= upto:
                    led.pending -= held
                else:
                    keep.append((i, held))
            retiring[s] = keep

    for ins in plan.instrs:
        if ins.kind is Action.WAIT and ins.event != plan.step_start:
            # a wait retires its stream's queue up to the op it waits for (FIFO); the step
            # start has no producer op (comm streams wait for compute: nothing to retire)
            producer = plan.producers[ins.event]
            retire(stream_of[producer], issued[producer])
        if ins.kind is not Action.RUN:
            continue
        op = ins.op
        if op.kind is Kind.STEP:
            retire(None, None)  # the update drains every stream first
        comm = 0  # this op's temporaries (see the module's docstring)
        held = 0  # a reduce-scatter's buffers, until it is retired
        if op.kind is Kind.ALLGATHER:
            led.gathered += numel[op.target] * g
            if g != FP32 and D > 1:
                comm = numel[op.target] // D * g  # the shard, cast for the gather (one
                # rank casts straight into the gathered buffer)
        elif op.kind is Kind.FREE:
            led.gathered -= numel[op.target] * g
        elif op.kind is Kind.BWD:
            for u in fs.units:
                live = (u.name, key(op.mb))
                if op.target in writers[u.name] and live not in grad_live:
                    grad_live[live] = numel[u.name] * g
                    led.grads += numel[u.name] * g
        elif op.kind is Kind.REDUCESCATTER:
            n, first = numel[op.target], op.target not in scattered
            # what it sends, in the reduce dtype, until retired: the unsharded gradient itself
            # (r = g, or the upcast's fp32 accumulator; one rank), its cast (one rank), or
            # gloo's copy of either (more ranks: then the cast is a temporary of the op,
            # dropped once copied)
            # One rank's reduce-scatter is a copy made when issued: it holds nothing after
            # it, and a cast to the reduce dtype is a temporary of the op.
            held = n * r if D > 1 else 0
            if r != g and not upcast:
                comm += n * r
            if not (first and r == FP32):
                # the output shard, added (or cast back) into the fp32 one when retired;
                # HSDP's, once its replicate all-reduce has summed it in place
                out = n // D * r
                comm, held = (comm + out, held) if spec.hsdp else (comm, held + out)
            led.pending += held
            if first:
                led.held += n // D * FP32  # the gradient shard comes into being
        led.at(op, comm, 0)  # the update allocates nothing (fused AdamW, foreach norms)
        if upcast and op.kind is Kind.BWD:
            for u in (u.name for u in fs.units if last_writer[u.name] == op.target):
                acc = (u, "acc")
                if acc not in grad_live:  # the first fold casts: both live for a moment
                    grad_live[acc] = numel[u] * FP32
                    led.grads += numel[u] * FP32
                    led.settle(str(op))
                led.grads -= grad_live.pop((u, op.mb))  # the micro-step's gradient, folded
        if op.kind is Kind.REDUCESCATTER:
            # the executor hands the unsharded gradient over (FlatUnit.take_grad): from here
            # only what the collective holds lives on, until it is retired (exec/backends.py)
            scattered.add(op.target)
            live = (op.target, "acc" if upcast else key(op.mb))
            if live in grad_live:
                led.grads -= grad_live.pop(live)
            retiring.setdefault(ins.stream, []).append((issued[op], held))
            if ins.stream == COMPUTE:
                retire(COMPUTE, issued[op])  # on compute a collective blocks, like a kernel
    return led.report(states)


# -- activations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActs:
    """Bytes one layer holds for one micro-step (see `layer_acts`)."""

    saved: int  # what autograd saves for its backward, its input included
    kept: int  # what a recomputing layer keeps instead: its input
    fwd: int  # transient on top while its forward runs
    bwd: int  # transient on top while its backward runs


def layer_acts(spec: Spec, layer: str) -> LayerActs:
    """What autograd saves for one layer of GPT-2 in one micro-step, in bytes.

    N = micro x seq_len tokens, C = n_embd, H = n_head, V = vocab, fp32 compute (the
    tensors autograd saves, read with saved_tensors_hooks on torch 2.13's CPU kernels;
    views of one storage count once):

    block h.i   16 C + 4 + H per token, fp32:
                ln_1: its input x (C) and mean, rstd (1 + 1); c_attn: ln_1's output (C);
                scaled_dot_product_attention (the CPU flash kernel, chosen for causal
                attention without dropout in fp32 and bf16; CUDA's flash and efficient
                kernels save the same): q, k, v (views of c_attn's output, 3 C), its output
                (C, laid out (B, T, H, hs), so the transpose back is a view that attn.c_proj
                saves for free) and the log-sum-exp (H); ln_2: x + attn (C) and mean, rstd;
                c_fc: ln_2's output (C); GELU: c_fc's output (4 C); mlp.c_proj: GELU's
                output (4 C). The residual adds save nothing.
    embed       the position indices, 8 T bytes (int64); the token ids are the batch's.
    head        2 C + 2 + V per token: ln_f's input and output, mean and rstd, and
                log_softmax's output (cross_entropy = log_softmax + nll_loss, which saves
                the targets: the batch's). The logits themselves are not saved.

    bf16 autocast (`compute = bf16`) saves the bf16 copies its matmuls read: per block 14 C
    bf16 + 2 C fp32 (the LayerNorms' inputs) + 4 + H fp32 per token, plus the bf16 casts
    of the block's weights (12 C^2 x 2 bytes, made again by every forward); the head the
    bf16 logits (V x 2) besides the fp32 log_softmax output (V x 4), C fp32 and C bf16.

    head, `loss chunk K` (model/gpt2.py ChunkedLinearCE, which makes the loss and its
                gradients in one pass over the logits): ln_f's input, mean and rstd (C + 2
                fp32 per token) and the Function's two gradients, grad h (N C fp32) and grad
                weight (V C in the weight's dtype: fp32, or the gather dtype under FSDP),
                kept from forward to backward in place of h. No logits and no log_softmax
                output are kept. A recomputing head's first forward runs without autograd and
                makes no gradients; its recompute makes them.

    A recomputing layer keeps only its input during forward (a block: N C in the compute
    dtype's residual stream, fp32; embed: nothing beyond the batch; head: N C), and holds
    `saved` again from its recompute to its backward.

    Transients, on top while the op runs (measured on the CPU heap, rounded up to whole
    tensors): a block's forward, the attention projection and MLP outputs before their
    residual adds (2 C); its backward, the gradients of the 4 C hidden and its input (about
    4 C + 4 C + 2 C); the head's forward, the logits (V); its backward, the gradient of
    log_softmax's output and of the logits (2 V) and of its input (C); embed's backward the
    gradient of its output (C).
    Chunked, with K = min(chunk, N): forward holds ln_f's output h (N C) and one chunk's
    logits and log-softmax (2 K V fp32; the softmax and the logits' gradient are made in
    place of the log-softmax); bf16: K V bf16 logits, their fp32 copy and log-softmax, the
    bf16 gradient of the logits, the bf16 casts of h and the weight (N C + V C), a chunk's
    (V, C) bf16 part of the weight's gradient before it is added in fp32, grad h in bf16
    before its fp32 copy, and, when the weight is 16-bit itself (FSDP's bf16 gather), the
    fp32 sum of the weight's gradient before its cast. Backward only hands the kept
    gradients on: its transient is ln_f's gradient of its input (N C fp32).
    """
    cfg, N = spec.model, spec.micro * spec.seq_len
    C, H, V = cfg.n_embd, cfg.n_head, cfg.vocab_size
    bf16 = spec.numerics.compute is not Dtype.FP32
    c = spec.numerics.compute.nbytes
    if layer == "embed":
        return LayerActs(8 * spec.seq_len, 0, N * C * FP32, N * C * FP32)
    if layer == "head" and spec.numerics.loss_chunk is not None:
        K = min(spec.numerics.loss_chunk, N)
        w = spec.numerics.gather.nbytes if spec.kind is Strategy.FSDP else FP32
        saved = N * (2 * C + 2) * FP32 + V * C * w  # ln_f's, grad h, grad weight
        fwd = N * C * FP32 + 2 * K * V * FP32  # h, one chunk's logits and log-softmax
        if bf16:
            casts = (N * C + V * C) * c
            fwd = N * C * FP32 + K * V * (2 * c + 2 * FP32) + casts + V * C * c + N * C * c
            fwd += V * C * FP32 if w != FP32 else 0
        return LayerActs(saved, N * C * FP32, fwd, N * C * FP32)
    if layer == "head":
        saved = N * ((2 * C + 2 + V) * FP32 if not bf16 else (C + 2 + V) * FP32 + (C + V) * c)
        return LayerActs(saved, N * C * FP32, N * V * c, N * (2 * V + C) * FP32)
    if bf16:
        saved = N * (14 * C * c + (2 * C + 4 + H) * FP32) + 12 * C * C * c
    else:
        saved = N * (16 * C + 4 + H) * FP32
    return LayerActs(saved, N * C * FP32, N * 2 * C * FP32, N * 10 * C * FP32)


class Activations:
    """Activation bytes live along a plan: each fwd adds what its layer saves (or keeps, when
    it recomputes), a recompute adds the rest back, a bwd releases its layer's; the step's
    token batches (int64 ids and targets of every micro-step) live throughout."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.of = {layer: layer_acts(spec, layer) for layer in spec.model.layers}
        self.batches = spec.accum * 2 * spec.micro * spec.seq_len * 8
        self.live = self.batches
        self.held: dict[tuple[str, int], int] = {}

    def step(self, op: Op) -> tuple[int, int]:
        """Account one op; (live after it, its transient on top while it runs)."""
        if op.kind not in (Kind.FWD, Kind.RECOMPUTE, Kind.BWD):
            return self.live, 0
        a, key = self.of[op.target], (op.target, op.mb)
        if op.kind is Kind.FWD:
            now = a.kept if op.target in self.spec.recompute else a.saved
            self.held[key] = now
            self.live += now
            return self.live, a.fwd
        if op.kind is Kind.RECOMPUTE:
            self.live += a.saved - self.held.get(key, 0)
            self.held[key] = a.saved
            return self.live, a.fwd
        transient = a.bwd + self.live  # its saved tensors live until its backward ends
        self.live -= self.held.pop(key, 0)
        return self.live, transient - self.live


def activation_peak(spec: Spec, plan: Plan) -> int:
    """The most activation bytes live at once along the plan."""
    acts, peak = Activations(spec), 0
    for op in plan.ops:
        live, transient = acts.step(op)
        peak = max(peak, live + transient)
    return peak


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

"""The cost model: how long each op of a plan takes (analysis/simulate.py says when it runs).

    duration   fwd         overhead + FLOPs of the layer for one micro-batch / the compute rate
               bwd         overhead + 2 x fwd's FLOPs / the rate
                           + the bytes of the parameter gradients it writes (fp32; the head's
                           include the tied vocab x d table, the embedding's rows are added
                           in place: `grad_bytes`) / grad_bandwidth (no term when unset)
               collective  latency + ring(kind, D) x bytes / bandwidth, bytes in the
                           collective's dtype (gather or reduce; ir/sizes.op_bytes)
                           ring: all-reduce 2(D-1)/D, all-gather and reduce-scatter (D-1)/D,
                           D the ranks of the op's mesh dimension (the world, when flat);
                           all-gathers and reduce-scatters take gather_* / scatter_*
                           latency and bandwidth when set (gloo's differ from its
                           all-reduce's), else the all-reduce's;
                           bandwidth: inter_bandwidth when that group spans nodes
               free        free (a storage release, no kernel)
               optimizer   28 bytes x parameters on the rank / mem_bandwidth (fp32 AdamW)
                           + the gradient norm's and clipping's bytes / norm_bandwidth (when
                           set): clipping's scale 8 per parameter, the norm DDP 4 (a read),
                           FSDP 36 (its shards in float64: the cast, the square, the sum, as
                           the executor does it)

The compute rate is the schedule's compute dtype's (`CostModel.rate`): bf16 autocast runs
its matmuls on bf16 tensor cores, fp32 on TF32 tensor cores unless the schedule says
`tf32 off` (unset, tf32 is on wherever there are tensor cores, and the cost model
describes a GPU), and fp32 with tf32 off on the CUDA cores. The defaults describe one node
of current data-centre GPUs (see `CostModel`); every number can be set on the command
line or fitted to a measured trace (`schedc calibrate`).
Times are seconds. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from schedc.analysis.units import fmt_rate, fmt_time
from schedc.files import read_limited
from schedc.ir.op import Kind, Op
from schedc.ir.sizes import op_bytes, padded, unit_numel
from schedc.ir.spec import Dtype, FSDPSpec, Numerics, Spec, Strategy
from schedc.model.arch import FP32, GPTConfig

FP32_POLICY = Numerics()
ADAMW_BYTES = 7 * FP32  # per parameter: read param, grad, m, v; write param, m, v
CLIP_BYTES = 2 * FP32  # per parameter: the gradient scaled in place (read, write)
NORM_BYTES = FP32  # DDP's norm: each gradient read once
NORM_BYTES_F64 = FP32 + 8 + 8 + 8 + 8  # FSDP's: shard to float64, square it, sum it


@dataclass(frozen=True)
class CostModel:
    """Throughputs and fixed costs of one GPU and its links (SI units)."""

    flops_bf16: float = 600e12
    """Effective compute throughput in bf16 (or fp16) autocast, FLOP/s: twice TF32's, as the
    dense tensor-core peaks of an H100/H200 are (989 vs 495 TFLOP/s)."""
    flops_tf32: float = 300e12
    """Effective throughput of fp32 compute with TF32 matmuls (tf32 on, or unset), FLOP/s:
    the rate schedc has always assumed, about 60% of an H100's dense TF32 peak."""
    flops_fp32: float = 40e12
    """Effective throughput of fp32 compute with `tf32 off`, FLOP/s: the CUDA cores, in the
    same proportion to TF32 as the peaks (67 vs 495 TFLOP/s). Measured on an H200 (issue
    13, GPT-2 124M): a compiled bf16 loop reached about 40% of the bf16 peak, eager TF32 and
    plain fp32 loops far less of theirs, so fit these to your runs (`schedc calibrate`)."""
    flops: float | None = None
    """One compute rate whatever the dtype, FLOP/s: what `--flops` sets (the rate of the
    schedule's compute dtype) and what a params.json from before per-dtype rates holds.
    None: the rate of the compute dtype, above."""
    bandwidth: float = 100e9
    """Bus bandwidth per GPU, bytes/s, as nccl-tests reports it (busbw: the ring factor is
    applied separately). 100 GB/s is a conservative NVLink ring or a 4 x 200 Gb/s
    InfiniBand node; NVLink 4 within one H100 node measures 300-450 GB/s."""
    inter_bandwidth: float | None = None
    """Bus bandwidth of a collective whose group spans nodes, bytes/s (`--inter-bandwidth`):
    the inter-node links (InfiniBand, RoCE), typically several times slower than NVLink.
    None: `bandwidth`, as if every link were as fast as the node's."""
    node_size: float = 8
    """Ranks per node (torchrun's --nproc_per_node): ranks node x node_size .. are one node,
    so a group spans nodes when its members' rank // node_size differ (`--node-size`)."""
    latency: float = 10e-6
    """Fixed cost of one collective, seconds: launch plus the ring's hop latencies."""
    mem_bandwidth: float = 2e12
    """Effective HBM bandwidth, bytes/s, for the memory-bound optimizer step."""
    free: float = 1e-6
    """Releasing a gathered unit's storage, seconds (host-side bookkeeping, no kernel)."""
    overhead: float = 0.0
    """Fixed cost of every forward and backward op, seconds: dispatch and allocation that
    do not scale with FLOPs. 0 on a GPU, where kernels queue behind each other; a CPU run
    pays it on its only thread (`schedc calibrate` fits it)."""
    grad_bandwidth: float | None = None
    """Bytes/s at which a backward writes the parameter gradients of the weights its layer
    reads (`grad_bytes`): a cost per micro-step, not per token. On a CPU the head's backward
    writes the tied weight's whole vocab x d gradient and adds it into .grad (about 40 ms
    for the mini model), so micro 1 with k = 4 pays it four times where micro 4 pays it
    once. None: no such term (a GPU writes it at HBM speed, inside the FLOPs term's error)."""
    norm_bandwidth: float | None = None
    """Bytes/s of the optimizer step's passes before AdamW: the global gradient norm and
    clipping's scale (FSDP sums its shards in float64, so it reads more per parameter than
    DDP). None: not priced (a few percent of a GPU's step); `schedc calibrate` sets it to the
    memory bandwidth it fits, as the same memory-bound passes."""
    gather_bandwidth: float | None = None
    """Bus bandwidth of all-gathers, bytes/s; None: `bandwidth` (what an all-reduce takes)."""
    gather_latency: float | None = None
    """Fixed cost of one all-gather, seconds; None: `latency`."""
    scatter_bandwidth: float | None = None
    """Bus bandwidth of reduce-scatters, bytes/s; None: `bandwidth`."""
    scatter_latency: float | None = None
    """Fixed cost of one reduce-scatter, seconds; None: `latency`."""

    def link_of(self, kind: Kind) -> tuple[float, float]:
        """(latency, bus bandwidth) of a collective of `kind` within a node."""
        if kind is Kind.ALLGATHER:
            lat, bw = self.gather_latency, self.gather_bandwidth
        elif kind is Kind.REDUCESCATTER:
            lat, bw = self.scatter_latency, self.scatter_bandwidth
        else:
            lat, bw = None, None
        return (self.latency if lat is None else lat, self.bandwidth if bw is None else bw)

    def rate_key(self, numerics: Numerics) -> str:
        """The field that holds the compute rate of a schedule's numerics."""
        if numerics.compute is not Dtype.FP32:
            return "flops_bf16"
        return "flops_fp32" if numerics.tf32 is False else "flops_tf32"

    def rate(self, numerics: Numerics) -> float:
        """Compute throughput, FLOP/s, of a schedule computing under `numerics`."""
        return self.flops if self.flops is not None else getattr(self, self.rate_key(numerics))

    def describe(self, numerics: Numerics = FP32_POLICY) -> str:
        key = self.rate_key(numerics)
        what = {
            "flops_bf16": f" ({numerics.compute})",
            "flops_tf32": "",
            "flops_fp32": " (fp32, tf32 off)",
        }[key]
        inter = (
            f" within a node of {self.node_size:g}, {fmt_rate(self.inter_bandwidth, 'B/s')} "
            "across nodes"
            if self.inter_bandwidth is not None
            else ""
        )
        extra = "".join(  # the CPU terms, where set (docs/tune.md)
            f", {text}"
            for text, on in (
                (f"{fmt_time(self.overhead)} per fwd/bwd op", self.overhead),
                (f"gradients at {fmt_rate(self.grad_bandwidth or 0, 'B/s')}", self.grad_bandwidth),
                (
                    f"all-gathers at {fmt_rate(self.gather_bandwidth or 0, 'B/s')}",
                    self.gather_bandwidth,
                ),
                (
                    f"reduce-scatters at {fmt_rate(self.scatter_bandwidth or 0, 'B/s')}",
                    self.scatter_bandwidth,
                ),
            )
            if on
        )
        return (
            f"{fmt_rate(self.rate(numerics), 'FLOP/s')} compute{what}, "
            f"{fmt_rate(self.bandwidth, 'B/s')} bus bandwidth{inter}, {fmt_time(self.latency)} "
            f"per collective{extra}"
        )

    def link(self, spec: Spec, op: Op) -> float:
        """The bus bandwidth of a collective: inter-node when its group (rank 0's, along the
        op's mesh dimension; every group of a dimension has the same shape) spans nodes."""
        within = self.link_of(op.kind)[1]
        if self.inter_bandwidth is None:
            return within
        return self.inter_bandwidth if spans_nodes(spec, op, self.node_size) else within

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, indent=2) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A params.json as `schedc calibrate -o` writes it; keys it lacks keep their default.
        Read through the bounded reader (a regular file of at most 64 KiB: a params file is
        a few hundred bytes); every value is a number in its parameter's range."""
        try:
            raw = read_limited(path, PARAMS_MAX_BYTES)
        except OSError as e:
            raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
        if len(raw) > PARAMS_MAX_BYTES:
            raise ValueError(f"{path}: larger than {PARAMS_MAX_BYTES >> 10} KiB; not a params file")
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ValueError(f"{path}: JSON nested too deeply (a params file is flat)") from None
        except ValueError as e:  # JSONDecodeError, bad UTF-8
            raise ValueError(f"{path}: not JSON: {e}") from None
        if not isinstance(data, dict):
            # a file's content: a bad value, not a programming error's TypeError
            raise ValueError(f"{path}: expected a JSON object of cost parameters")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{path}: unknown cost parameter{'s' * (len(unknown) != 1)} "
                f"{', '.join(map(repr, unknown[:5]))}; known: {', '.join(sorted(known))}"
            )
        values = {}
        for k, v in data.items():
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{path}: {k}: expected a number, got {json.dumps(v)[:40]}")
            values[k] = check_parameter(k, float(v), where=f"{path}: ")
        return cls(**values)

    def with_(self, **changes: float | None) -> CostModel:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


MAY_BE_ZERO = ("latency", "free", "overhead", "gather_latency", "scatter_latency")
PARAMS_MAX_BYTES = 64 << 10

# What each parameter may be, from a flag or a params file: a rate between 1 and 1e24 a
# second (a yottaFLOP/s), a time between 0 and an hour, a node of 1 to a million ranks.
# Outside them a timeline cannot be drawn (a step of 1e300 s has no time scale) and no real
# machine is described.
RATE, TIME, RANKS = (1.0, 1e24, "/s"), (0.0, 3600.0, " s"), (1.0, 1e6, " ranks")


def parameter_range(name: str) -> tuple[float, float, str]:
    """(lowest, highest, unit) a cost parameter may take."""
    if name == "node_size":
        return RANKS
    return TIME if name in MAY_BE_ZERO else RATE


def check_parameter(name: str, value: float, where: str = "") -> float:
    """`value`, if it lies in `name`'s range; else ValueError saying the range."""
    lo, hi, unit = parameter_range(name)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{where}{name} must be between {lo:g} and {hi:g}{unit}, got {value:g}")
    return value


# -- durations ------------------------------------------------------------------------------------


def ring_factor(kind: Kind, world: int) -> float:
    """Bytes each rank sends per byte of the collective's (full) buffer, on a ring."""
    if kind is Kind.ALLREDUCE:
        return 2 * (world - 1) / world
    if kind in (Kind.ALLGATHER, Kind.REDUCESCATTER):
        return (world - 1) / world
    return 0.0


def group_size(spec: Spec, op: Op) -> int:
    """The ranks a collective runs over: its mesh dimension's size (the world, when flat)."""
    return spec.mesh.size(spec.dim_of(op))


def spans_nodes(spec: Spec, op: Op, node_size: float) -> bool:
    """Whether a collective's group holds ranks of more than one node."""
    per = max(1, int(node_size))
    return len({r // per for r in spec.mesh.members(0, spec.dim_of(op))}) > 1


def op_flops(spec: Spec, op: Op, micro: int | None = None) -> float:
    """FLOPs of a forward or backward op for one micro-batch of `micro` sequences (the
    schedule's micro size when None; backward = 2 x forward; a recompute is its layer's
    forward again)."""
    if op.kind not in (Kind.FWD, Kind.BWD, Kind.RECOMPUTE):
        return 0.0
    m = spec.micro if micro is None else micro
    f = spec.model.layer_fwd_flops(op.target, m * spec.seq_len, spec.seq_len)
    return 2 * f if op.kind is Kind.BWD else f


def comm_volume(spec: Spec, op: Op) -> float:
    """Bytes each rank moves for a collective on a ring: ring factor x buffer bytes."""
    return ring_factor(op.kind, group_size(spec, op)) * op_bytes(spec, op)


def grad_bytes(spec: Spec, op: Op) -> float:
    """Bytes of parameter gradient a backward writes densely, whatever the batch: every
    parameter its layer's forward reads, fp32, the tied wte for `head` too (its matmul's
    weight gradient is a whole vocab x d table, added into .grad), but not for `embed`,
    whose backward adds only its tokens' rows into .grad in place (model/gpt2.py
    EmbeddingIntoGrad; a compiled region keeps the dense vocab x d gradient)."""
    if op.kind is not Kind.BWD:
        return 0.0
    return layer_grad_bytes(spec.model, op.target, spec.numerics.compile)


def layer_grad_bytes(model: GPTConfig, layer: str, compiled: bool = False) -> float:
    """`grad_bytes` of one layer's backward (`compiled`: the embedding's gradient dense)."""
    rows_only = layer == "embed" and not compiled
    return FP32 * sum(
        p.numel
        for p in model.params
        if layer in model.users(p.name) and not (rows_only and p.name == "wte.weight")
    )


def norm_per_param(kind: Strategy, clip: float) -> int:
    """Bytes the gradient norm and clipping read and write per parameter (see the top)."""
    norm = NORM_BYTES_F64 if kind is Strategy.FSDP else NORM_BYTES
    return (CLIP_BYTES if clip > 0 else 0) + norm


def optimizer_params(spec: Spec) -> float:
    """Parameters the optimizer step updates on one rank (FSDP: its shards only)."""
    if isinstance(spec.strategy, FSDPSpec):  # spec.kind is Strategy.FSDP
        S = spec.mesh.shard  # a rank updates its shard of S
        return sum(padded(unit_numel(spec, u), S) for u in spec.strategy.units) / S
    return spec.model.numel


def optimizer_bytes(spec: Spec, norm: bool = False) -> float:
    """Bytes AdamW reads and writes on one rank, and with `norm` the norm's and clipping's."""
    n = optimizer_params(spec)
    return n * (ADAMW_BYTES + (norm_per_param(spec.kind, spec.optim.clip) if norm else 0))


def optimizer_time(kind: Strategy, clip: float, params: float, cost: CostModel) -> float:
    """The optimizer step on a rank updating `params` parameters."""
    t = ADAMW_BYTES * params / cost.mem_bandwidth
    if cost.norm_bandwidth:
        t += norm_per_param(kind, clip) * params / cost.norm_bandwidth
    return t


def compute_time(flops: float, gbytes: float, rate: float, cost: CostModel) -> float:
    """A forward's or backward's duration from its FLOPs and gradient bytes."""
    grads = gbytes / cost.grad_bandwidth if cost.grad_bandwidth and gbytes else 0.0
    return cost.overhead + flops / rate + grads


def duration(spec: Spec, op: Op, cost: CostModel) -> float:
    if op.kind in (Kind.FWD, Kind.BWD, Kind.RECOMPUTE):
        return compute_time(
            op_flops(spec, op), grad_bytes(spec, op), cost.rate(spec.numerics), cost
        )
    if op.is_collective:
        return cost.link_of(op.kind)[0] + comm_volume(spec, op) / cost.link(spec, op)
    if op.kind is Kind.FREE:
        return cost.free
    return optimizer_time(spec.kind, spec.optim.clip, optimizer_params(spec), cost)

"""How a rank holds its parameters and gradients, and reduces them: the part of a step that
differs between DDP and FSDP (torchtitan's apply_ddp / apply_fsdp, as objects).

    Replicated   every rank holds every parameter; gradients accumulate into flat buckets
                 (DDP: one all-reduce each; one process: a single bucket, never sent)
    Sharded      FSDP: units gathered into full buffers before use and freed after, their
                 gradients reduce-scattered into this rank's shard; under HSDP each shard's
                 gradient is then all-reduced over the replicate group

Both give the executor the same surface: the optimizer's parameters; `begin_step`; what a
backward segment needs before and after it; `collective` and `free` for the plan's ops;
for the update the gradients it clips and their global norm, and `after_update`; the model
states' tensors; full gradients and parameters for tests. Buffers are allocated and freed
where the plan's lifetimes say (ir/effects.py), each logged by its name there when the
executor keeps a buffer log.

Numerics (`spec.numerics`, FSDP2's MixedPrecisionPolicy and DDP's bf16_compress_hook): a
DDP bucket stays fp32; its all-reduce casts it into a buffer of the reduce dtype on the comm
stream and copies the average back. An FSDP unit is gathered in the gather dtype: the fp32
shard is cast on the comm stream and the gathered parameters the layers compute with are in
that dtype, so are their unsharded gradients; the reduce-scatter casts them to the reduce
dtype and adds the result into the fp32 gradient shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from schedc.exec.backends import Backend
from schedc.exec.flat import FlatBucket, FlatUnit
from schedc.exec.fuse import Segment
from schedc.exec.options import Comm
from schedc.ir.bound import Bound
from schedc.ir.effects import grad_buffer, scatter_output, shard_grad, upcast
from schedc.ir.op import COMPUTE, Kind, Op
from schedc.ir.spec import BucketSpec, FSDPSpec, Spec
from schedc.model.reference import adamw_groups, global_grad_norm, make_adamw

Log = Callable[[str, str], None] | None  # (action, buffer): the executor's buffer log, if kept


class _Base:
    """What both strategies share: the job, the backend, bytes counted per collective."""

    def __init__(
        self,
        spec: Spec,
        bound: Bound,
        comm: Comm,
        backend: Backend,
        params: dict,
        reduce_dtype,
        log: Log,
    ):
        self.spec, self.bound, self.comm = spec, bound, comm
        self.backend, self.params = backend, params
        self.reduce_dtype = reduce_dtype
        self.log = log
        self.comm_bytes: dict[str, int] = {}
        self.mem = {"gathered_peak": 0, "grads_peak": 0}  # FSDP's, measured (`measure`)
        self.buckets: dict[str, FlatBucket] = {}
        self.units: dict[str, FlatUnit] = {}
        self.pending_frees: dict[str, tuple[object, str]] = {}

    def begin_step(self) -> None:
        self.comm_bytes = {}

    def before_backward(self, seg: Segment) -> None:
        pass

    def after_backward(self, seg: Segment) -> None:
        pass

    def reclaim(self, stream: str | None, unit: str | None = None) -> None:
        pass

    def count(self, op: Op, numel: int, dtype: torch.dtype) -> None:
        """Bytes a collective moves per rank: its buffer's elements in the dtype it moves."""
        key = f"{op.kind.value}[{op.target}]"
        self.comm_bytes[key] = self.comm_bytes.get(key, 0) + numel * dtype.itemsize


class Replicated(_Base):
    """DDP's buckets, or one process's single bucket: flat gradient buffers that every
    parameter's .grad is a view of, all-reduced (averaged) where the plan says."""

    def __init__(self, *args, **kwargs):  # _Base's
        super().__init__(*args, **kwargs)
        params, bound = self.params, self.bound
        # the plan's buckets (one of every parameter on one process, never communicated)
        self.buckets = {
            name: FlatBucket(BucketSpec(name, names, None, 0), params)
            for name, names in bound.buckets.items()
        }

    def optimizer(self):
        return make_adamw(self.params.items(), self.spec.optim)

    def begin_step(self) -> None:
        super().begin_step()
        for b in self.buckets.values():
            b.flat.zero_()

    def collective(
        self, stream: str, op: Op, keeps: tuple[str, ...] = (), divisor: int = 1
    ) -> None:
        """A bucket's all-reduce: each rank's x/D, summed, is the average (D: the plan's
        divisor)."""
        b, D, rd = self.backend, divisor, self.reduce_dtype
        flat = self.buckets[op.target].flat
        self.count(op, flat.numel(), rd)
        held: dict[str, torch.Tensor] = {}

        def launch(pg, flat=flat, held=held):
            if D != 1:
                flat.div_(D)  # sum of x/D over ranks = the average
            if flat.dtype == rd:
                return b.all_reduce(flat)(pg)
            # bf16_compress_hook: the bucket's values in the reduce dtype, on this stream
            held["low"] = low = flat.to(rd)
            return b.all_reduce(low)(pg)

        def back(flat=flat, held=held):
            flat.copy_(held.pop("low"))  # the summed average, back into the fp32 bucket

        b.collective(stream, op, launch, None if flat.dtype == rd else back, self.spec.dim_of(op))

    def free(self, op: Op) -> None:
        raise AssertionError(f"{op}: a replicated schedule frees nothing")

    def update_grads(self) -> list[torch.Tensor]:
        return [b.flat for b in self.buckets.values()]

    def norm(self) -> torch.Tensor:
        return global_grad_norm([p.grad for p in self.params.values()])

    def states(self) -> list[torch.Tensor]:
        return list(self.params.values()) + [b.flat for b in self.buckets.values()]

    def after_update(self, keeps: tuple[str, ...]) -> None:
        pass

    def full_tensors(self, *, grad: bool) -> dict[str, torch.Tensor]:
        return {n: (p.grad if grad else p).detach().clone() for n, p in self.params.items()}

    def measure(self) -> None:
        pass


class Sharded(_Base):
    """FSDP's units (and HSDP's replicate all-reduce): each rank holds its shard of every
    unit's flat parameter; a unit is gathered before use and freed after, and its gradient
    reduce-scattered into the shard (exec/flat.py FlatUnit)."""

    def __init__(
        self,
        spec: Spec,
        bound: Bound,
        comm: Comm,
        backend: Backend,
        params: dict,
        reduce_dtype,
        log: Log,
        gather_dtype,
        measure: bool,
    ):
        super().__init__(spec, bound, comm, backend, params, reduce_dtype, log)
        fsdp = spec.strategy
        assert isinstance(fsdp, FSDPSpec), "Sharded holds an FSDP schedule's units"
        # units shard over the shard dimension: this rank holds chunk `index` of `S` (the
        # plan's: ir/bound.py)
        index, S = bound.shard or 0, spec.mesh.shard
        # no_sync under a reduce dtype wider than the gather's: FSDP2's upcast, micro-steps
        # accumulate in the reduce dtype (flat.py FlatUnit.fold)
        self.upcast = upcast(spec)
        accumulate = reduce_dtype if self.upcast else None
        # each unit laid out in its bound flat order (the proof's layout, ir/bound.py)
        laid = (replace(u, params=bound.units[u.name]) for u in fsdp.units)
        self.units = {
            u.name: FlatUnit(u, spec.model, params, index, S, gather_dtype, accumulate)
            for u in laid
        }
        if log is not None:
            for u in self.units.values():
                u.log = log
        writers = {u.name: spec.writers(u.params) for u in fsdp.units}
        # the units whose gradients each layer's backward writes into
        self.writes = {
            layer: [self.units[n] for n, ws in writers.items() if layer in ws]
            for layer in spec.model.layers
        }
        # gathered units freed on compute whose storage is not yet given back: unit ->
        # (the free's mark on compute, the stream whose gather allocated the storage)
        self.gathered_on: dict[str, str] = {}
        self.scattered: set[str] = set()  # units reduce-scattered so far this step
        # HSDP: (unit, micro-step) -> a reduce-scatter's output, for its replicate all-reduce
        self.scatter_out: dict[tuple[str, int], tuple] = {}
        self.measuring = measure

    def optimizer(self):
        decay, plain = [], []
        for u in self.units.values():
            d, p = u.optimizer_params()
            decay += d
            plain += p
        return adamw_groups(decay, plain, self.spec.optim)

    def begin_step(self) -> None:
        super().begin_step()
        self.scattered = set()
        self.scatter_out = {}

    # -- backward ------------------------------------------------------------------------

    def before_backward(self, seg: Segment) -> None:
        """The unsharded gradients this backward adds into."""
        key = self.bound.grad_keys[seg.mb]
        for unit in {u.name: u for layer in seg.layers for u in self.writes[layer]}.values():
            unit.grad_buffer(key)

    def after_backward(self, seg: Segment) -> None:
        self.measure()
        if self.upcast:  # a unit whose micro-step backward is done folds it (FSDP2)
            key = self.bound.grad_keys[seg.mb]
            for layer in seg.layers:
                for name in self.bound.folds.get(layer, ()):
                    self.units[name].fold(key, self.measure)

    # -- gathered units ------------------------------------------------------------------

    def free(self, op: Op) -> None:
        """The unit's last use on compute is done; its storage goes back later, by reclaim.

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

    def reclaim(self, stream: str | None, unit: str | None = None) -> None:
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

    # -- collectives ---------------------------------------------------------------------

    def collective(
        self, stream: str, op: Op, keeps: tuple[str, ...] = (), divisor: int = 1
    ) -> None:
        if op.kind is Kind.ALLGATHER:
            self._gather(stream, op)
        elif op.kind is Kind.REDUCESCATTER:
            self._reduce_scatter(stream, op, keeps, divisor)
        else:
            self._replicate(stream, op, keeps, divisor)

    def _gather(self, stream: str, op: Op) -> None:
        b, unit, S = self.backend, self.units[op.target], self.spec.mesh.shard
        # every shard of the shard group arrives, in the gather dtype: the full unit
        self.count(op, unit.shard.numel() * S, unit.full.dtype)
        self.reclaim(stream, unit.name)  # freed storage this gather may reuse
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

        b.collective(stream, op, launch, None, self.spec.dim_of(op))
        self.measure()

    def _reduce_scatter(self, stream: str, op: Op, keeps: tuple[str, ...], D: int) -> None:
        """`D`: the plan's divisor (the world: gradients are averaged over every rank,
        whatever the mesh)."""
        b, unit, rd = self.backend, self.units[op.target], self.reduce_dtype
        grad = unit.take_grad(self.bound.grad_keys[op.mb])
        keep = grad_buffer(self.spec, unit.name, op.mb) in keeps
        self.count(op, grad.numel(), rd)
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
                unit.live_shard_grad()
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
                send = grad.div_(D) if D != 1 else grad
                send = send.to(rd)  # a no-op when the dtypes agree
            else:  # bf16 gradients (bf16 gather) reduced in fp32
                send = grad.to(rd)
                if D != 1:
                    send.div_(D)
            return b.reduce_scatter(held["out"], send)(pg)

        def done(unit=unit, held=held, first=first):
            out = held.pop("out")
            if first:  # the first shard of the step, cast back into the fp32 gradient
                unit.live_shard_grad().copy_(out)
            else:
                unit.live_shard_grad().add_(out)  # accumulate this micro-step's shard (upcast)

        holds = self._holds(unit.name, op.mb, direct)
        dim = self.spec.dim_of(op)
        if self.spec.hsdp:  # the replicate all-reduce sums `out` first, then lands it
            self.scatter_out[(unit.name, op.mb)] = (held, direct, done)
            b.collective(stream, op, launch, self._released(holds), dim)
        else:
            land = None if direct else done
            b.collective(stream, op, launch, self._released(holds, land), dim)

    def _replicate(self, stream: str, op: Op, keeps: tuple[str, ...], divisor: int = 1) -> None:
        """HSDP: sum a unit's reduce-scattered gradient shard over the replicate group, each
        member's share divided by the plan's `divisor` first (1 as lowered: the
        reduce-scatter already divided by the whole world, each rank's gradient x 1/D summed
        over the shard group, so the sum over the replicate group is the average over every
        rank; a plan that splits D between the two runs as it says, as the proof reads it).

        It reads the reduce-scatter's output, which the stream's order makes complete first,
        and then does what the reduce-scatter's completion would have done: add (or cast)
        the shard into the fp32 gradient shard."""
        b, unit = self.backend, self.units[op.target]
        held, direct, done = self.scatter_out.pop((op.target, op.mb))
        self.count(op, unit.shard_len, self.reduce_dtype)

        # allocated on the reduce-scatter's stream: when that is another stream, its block
        # must not go back to it before this all-reduce (and its completion) has read it
        keep = scatter_output(op.target, op.mb) in keeps

        def launch(pg, held=held, keep=keep):
            if keep:
                b.keep_alive(held["out"], stream)
            if divisor != 1:
                held["out"].div_(divisor)
            return b.all_reduce(held["out"])(pg)  # direct: the new gradient shard itself

        # the reduce-scatter's output, a temporary unless direct, goes when this retires
        out = [] if direct or self.log is None else [scatter_output(op.target, op.mb)]
        land = None if direct else done
        b.collective(stream, op, launch, self._released(out, land), self.spec.dim_of(op))

    def _holds(self, unit: str, mb: int, direct: bool) -> list[str]:
        """What a reduce-scatter being issued holds until it is retired (ir/effects.py):
        what it sends, over more than one rank, and its output when that is a temporary."""
        if self.log is None:
            return []
        holds = [f"rs_in[{unit}]@mb{mb}"] if self.spec.mesh.shard > 1 else []
        if not direct:
            holds.append(scatter_output(unit, mb))
        for h in holds:
            self.log("hold", h)
        # HSDP: the output lives on until the replicate all-reduce that reads it retires
        return [h for h in holds if not (self.spec.hsdp and h.startswith("rs_out"))]

    def _released(self, holds: list[str], done=None):
        """`done`, telling the buffer log that the collective's holds went (when logging)."""
        if not holds:
            return done

        def released():
            for h in holds:
                self.log("release", h)
            if done is not None:
                done()

        return released

    # -- the update ----------------------------------------------------------------------

    def update_grads(self) -> list[torch.Tensor]:
        return [u.live_shard_grad() for u in self.units.values()]

    def norm(self) -> torch.Tensor:
        """The global norm: each rank's shards' squared norm, summed over the job; every
        replica holds the same shards (HSDP), so the sum counts each R times."""
        sq = torch.stack(torch._foreach_norm(self.update_grads())).square().sum()
        if self.comm.world > 1:
            dist.all_reduce(sq, group=self.comm.group)
            if self.spec.mesh.replicate > 1:
                sq /= self.spec.mesh.replicate
        return sq.sqrt()

    def states(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units.values()]

    def after_update(self, keeps: tuple[str, ...]) -> None:
        """Free the gradient shards (they come back at the next step's first reduce-scatter)."""
        for u in self.units.values():
            if u.shard_grad is not None and shard_grad(u.name) in keeps:
                # allocated on a comm stream by the reduce-scatter, read by compute (norm, clip,
                # AdamW): freed now on the host, its block must wait for compute (FSDP2 keeps
                # the gradient referenced until the next step instead, _fsdp_collectives.py)
                self.backend.keep_alive(u.shard_grad, COMPUTE)
            u.drop_shard_grad()

    def full_tensors(self, *, grad: bool) -> dict[str, torch.Tensor]:
        """Full gradients or parameters by name, gathered from the shards (tests, and the
        validation model: exec/evaluate.py)."""
        names = {id(p): n for n, p in self.params.items()}
        out = {}
        for u in self.units.values():
            src = u.live_shard_grad() if grad else u.shard
            # every rank's shard, in rank order: each replica's S shards in turn (HSDP), of
            # which the first replica's are the unit
            full = torch.empty(
                u.padded * self.spec.mesh.replicate, dtype=src.dtype, device=src.device
            )
            if "all_gather_into_tensor" in getattr(self.backend, "fallbacks", ()):
                # gloo on CUDA tensors (ranks sharing a GPU) without the flat form: the list
                dist.all_gather(list(full.chunk(self.comm.world)), src, group=self.comm.group)
            elif self.comm.world > 1:  # all_gather_single: its name from torch 2.13
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather(full, src.contiguous(), group=self.comm.group)
            else:
                full.copy_(src)
            out.update({names[id(p)]: t for p, t in u.assemble(full[: u.padded]).items()})
        return out

    def measure(self) -> None:
        """The gathered and unsharded-gradient bytes now, into their peaks (`measure` on)."""
        if not self.measuring:
            return
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units.values())
        grads = sum(
            g.numel() * g.element_size()
            for u in self.units.values()
            for g in [*u.grads.values(), *([u.acc] if u.acc is not None else [])]
        )
        self.mem["gathered_peak"] = max(self.mem["gathered_peak"], gathered)
        self.mem["grads_peak"] = max(self.mem["grads_peak"], grads)

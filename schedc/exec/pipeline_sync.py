"""Data parallelism per pipeline stage: how a rank's stages are kept in step with the same
stages of the other replicas (DDP or FSDP under PP), as objects the executor owns.

    ReplicatedStages   every replica holds the stage's parameters; a stage's gradients are
                       all-reduced over its replicas in one flat bucket (DDP)
    ShardedStages      FSDP per stage: each unit sharded over the replicas, gathered for the
                       step, its gradient reduce-scattered into this rank's shard

Both run what the rank's bound plan (passes/pipeline_bind.py, the plan the proof read) says:
which buckets or units it holds, after which stage op each reduction is launched and before
which each gather, and every divisor. Both give the executor (exec/pipeline.py) the same
surface (`StageSync`): the optimizer; `begin_step`; `before` an action (the gathers);
`before_forward` of a stage; `before_backward` / `after_backward` of a backward that
writes a stage's weights; `after_compute` of each action, which launches the
reductions of the gradients it is the last to write; `wait` for them before the update;
for the update the gradients it clips and those the norm counts, whether this rank's
squares count (`counts_norm`) and `after_update`; full tensors for tests; and `ran`, the
step's plan as it ran (each op with its group's global ranks and divisor, `issue`), which
tests hold equal to the bound plan.

DP x PP (`replicas` > 1): the pipeline is replicated, ranks laid out pp-outermost
(exec/pipeline_comm.py); replica d runs micro-batch j of the slice the DP executor gives
rank d of dp at micro-step j (model/batching.py sequence_ids), so the replicas together
read the global batch once. Each stage's gradients are all-reduced over the ranks holding
it in every replica (`PipeComm.dp`) in one flat bucket (no ddp block), or in the
ddp block's buckets, each inside a stage (the head's copy of the tied wte with the bucket
holding the head's own parameters), all launched right after the program's last B or W of
that stage (pipelining's REDUCE_GRAD) in reverse layer order, as each rank's x / dp, and
waited for before the update.
The tied embedding's two copies (first stage's embed, last stage's head) then get the sum
of their gradients by an all-reduce on the 2-rank group of those ranks within each replica,
as Megatron all-reduces its "embedding group"; the norm is replica 0's pipeline ranks' sum
(the other replicas add zeros: after the reduction their gradients are bitwise replica
0's), the tied weight counted once (on the embed's rank).

FSDP per stage (`Bound.units`, torchtitan's FSDP2 under PP): each unit lies in one stage
and is a FlatUnit (exec/flat.py) sharded over the dp group. Every unit's all-gather is
launched at the rank's first F of the step and waited for before its stage's first F; the
unit stays gathered through the step (reshard_after_forward=False), its micro-batches'
gradients accumulate in one unsharded buffer (folded into the reduce dtype when that is
wider than the gather's: FSDP2's upcast), and after the stage's last B or W it is
reduce-scattered (async, waited for before the update) and freed. AdamW steps the shards;
the norm sums every rank's shards. Under HSDP per stage (a `mesh R x S` of the dp replicas,
exec/pipeline_comm.py) a unit is sharded over the rank's S-rank shard group, gathered and
reduce-scattered there, and each gradient shard is then summed over the R ranks holding the
same shard (the DP executor's HSDP); AdamW steps the S-shard, and the norm counts the
replicate group's first rank's shards (the others' are bitwise the same). The tied wte is
a unit of its own on both ends, one layout, so the tied all-reduce sums the same slice on
each replica's pair.

Numerics (`PipeJob.gather/reduce`): units gathered in the gather dtype, dp reductions in
the reduce dtype, each rank's share x / dp divided in the wider of its dtype and that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from schedc.exec.backends import DONE, copy_alone
from schedc.exec.cpu_backend import CPUBackend
from schedc.exec.flat import FlatUnit
from schedc.exec.pipeline_comm import PipeComm
from schedc.exec.pipeline_model import PipeJob, RankModel
from schedc.ir.bound import Bound
from schedc.ir.op import Kind, Op
from schedc.ir.plan import Instr
from schedc.ir.source import Span
from schedc.ir.spec import REPLICATE, TIED, UnitSpec
from schedc.model.reference import adamw_groups, make_adamw


class StageSync:
    """What both cases share: the job, this rank's place and model, the bucket each action
    completes, and the step's reductions in flight; no-ops where the DDP case has nothing
    to do."""

    def __init__(self, job: PipeJob, comm: PipeComm, model: RankModel, bound: Bound) -> None:
        self.job, self.comm, self.model = job, comm, model
        self.named = list(model.named_parameters())
        self.reduce = job.reduce or job.dtype
        self.buckets: dict[Op, list] = {}
        self.reductions: list[tuple] = []  # (work, what to do once it is done)
        # the plan's sum of the tied wte's two copies, if this rank holds one end
        self.tied = next((i for i in bound.plan.instrs if _is_tied(i.op)), None)
        # this step's plan as it ran: each op with its group's global ranks and divisor, in
        # issue order, as the bound plan's instructions say them (tests compare the two)
        self.ran: list[tuple[Op, tuple[int, ...], int]] = []
        self._members: dict = {}

    def optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    @property
    def wire(self) -> torch.dtype:
        """The dtype of the weights the layers compute with: what P2P carries."""
        return self.job.dtype

    @property
    def counts_norm(self) -> bool:
        """Whether this rank's squared gradients count in the global norm."""
        raise NotImplementedError

    def begin_step(self) -> None:
        self.reductions, self.ran = [], []

    def issue(self, op: Op, group=None, divisor: int = 1) -> None:
        """Note `op` as run over `group` (a process group, its global ranks, or None: this
        rank alone) with `divisor`."""
        if not isinstance(group, tuple):
            if group not in self._members:
                ranks = (self.comm.me,) if group is None else dist.get_process_group_ranks(group)
                self._members[group] = tuple(ranks)
            group = self._members[group]
        self.ran.append((op, group, divisor))

    def before(self, act: Op) -> None:
        """Before the program runs `act`: what the plan launches there (FSDP's gathers)."""

    def before_forward(self, stage: int) -> None:
        pass

    def before_backward(self, stage: int) -> None:
        pass

    def after_backward(self, stage: int) -> None:
        pass

    def after_compute(self, act: Op) -> None:
        """The gradients `act` completes, summed over the replicas, launched now (nothing
        after this action writes them: pipelining's REDUCE_GRAD), waited for in `wait`
        before the update."""
        if bucket := self.buckets.get(act):
            self._reduce(bucket)

    def _reduce(self, done: list) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Each reduction in launch order, then what lands it (which may launch one more,
        HSDP's replicate all-reduce, waited for in turn)."""
        while self.reductions:
            work, land = self.reductions.pop(0)
            work.wait()
            land()

    def grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients the update clips and steps, and those the norm counts."""
        raise NotImplementedError

    def after_update(self) -> None:
        pass

    def full_tensors(self, grad: bool) -> dict[str, torch.Tensor]:
        """Whole gradients (`grad`) or parameters by name, for tests."""
        raise NotImplementedError

    def _collective(self, launch, copy: tuple | None = None):
        """`launch` on the dp group, async; one replica: nothing to send (a copy, if given)."""
        if self.comm.replicas > 1:
            return launch(self.comm.dp)
        if copy is not None:
            copy_alone(*copy)
        return DONE

    def sum_tied(self, grad: torch.Tensor) -> None:
        """The plan's sum of the tied copies' gradients (or shards) over their pair of
        ranks, each share divided by the instruction's divisor (1: a sum)."""
        assert self.tied is not None and self.tied.op is not None and self.comm.tied is not None
        self.issue(self.tied.op, self.comm.tied, self.tied.divisor)
        if self.tied.divisor != 1:
            grad.div_(self.tied.divisor)
        dist.all_reduce(grad, group=self.comm.tied)

    def _tied(self) -> torch.nn.Parameter | None:
        return dict(self.named).get("wte.weight")


class ReplicatedStages(StageSync):
    """DDP per stage: each stage's flat buckets (one a stage, or the ddp block's), all-reduced
    over the replicas (none with one replica); the tied copies summed over their pair of
    ranks before the update."""

    def __init__(self, job: PipeJob, comm: PipeComm, model: RankModel, bound: Bound) -> None:
        """Each bucket's all-reduce where the rank's bound plan runs it: after the stage op
        before it (passes/pipeline_bind.py, what the proof read), with its divisor: per
        action, the buckets it completes, as (parameters, the divisor of each share)."""
        super().__init__(job, comm, model, bound)
        own, last = dict(self.named), None
        for ins in bound.plan.instrs:
            op = ins.op
            if op is not None and op.kind.on_stage:
                last = op
            elif op is not None and op.kind is Kind.ALLREDUCE and op.target in bound.buckets:
                assert last is not None, f"{op} before any stage op"
                bucket = ([own[n] for n in bound.buckets[op.target]], ins.divisor, op)
                self.buckets.setdefault(last, []).append(bucket)

    def optimizer(self) -> torch.optim.Optimizer:
        return make_adamw(self.named, self.job.optim)

    @property
    def counts_norm(self) -> bool:
        return not self.comm.replica  # every replica's gradients are bitwise replica 0's

    def _reduce(self, done: list) -> None:
        """Each bucket `done` completes, in order, a flat all-reduce: each rank's share
        x / dp before the sum, in the reduce dtype (the DP executor's order: the division in
        the wider dtype)."""
        for params, divisor, op in done:
            self._reduce_bucket(params, divisor, op)

    def _reduce_bucket(self, params: list, divisor: int, op: Op) -> None:
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads), "a bucket's gradient was never written"
        flat = torch._utils._flatten_dense_tensors(grads)
        send = _share(flat, divisor, self.reduce)
        self.issue(op, self.comm.dp, divisor)
        work = self._collective(lambda pg: dist.all_reduce(send, group=pg, async_op=True))

        def land(send=send, flat=flat, grads=grads):
            flat.copy_(send)  # a no-op view copy when no cast
            for g, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(mean)

        self.reductions.append((work, land))

    def grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every parameter's gradient, the tied copies' summed by an all-reduce on the pair
        of ranks holding them (embed's part + head's part); and those the norm counts (the
        tied weight once, on the embed's rank)."""
        wte = self._tied()
        if self.tied is not None:  # this rank holds one end of the pair
            assert wte is not None and wte.grad is not None
            self.sum_tied(wte.grad)
        grads = [p.grad for _, p in self.named if p.grad is not None]
        assert len(grads) == len(self.named), "a parameter the loss does not reach"
        counted = [g for (n, _), g in zip(self.named, grads) if not self._tied_copy(n)]
        return grads, counted

    def _tied_copy(self, name: str) -> bool:
        return name == "wte.weight" and self.model.holds_tied_copy

    def full_tensors(self, grad: bool) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in self.named:
            t = p.grad if grad else p
            assert t is not None, f"{n} has no gradient"
            out[n] = t.detach().clone()
        return out


class ShardedStages(StageSync):
    """FSDP per stage: this rank's units, gathered at the step's first forward and kept,
    their gradients reduce-scattered into the shards after the stage's last backward."""

    def __init__(
        self, job: PipeJob, comm: PipeComm, model: RankModel, stages: list[int], bound: Bound
    ) -> None:
        super().__init__(job, comm, model, bound)
        self.units = self._shard(bound.units.items())
        self.readers = {s: self._readers(s) for s in stages}
        self.gathers: dict[FlatUnit, tuple] = {}  # launched, not waited for: (work, shard sent)
        self.gathered: set[FlatUnit] = set()  # this step's, waited for
        # the plan's gathers launched before an action, as (unit, op)
        self.launch: dict[Op, list[tuple[FlatUnit, Op]]] = {}
        self.replicated: dict[str, Instr] = {}  # HSDP: each shard's replicate all-reduce
        self._bound_units(bound)

    def _bound_units(self, bound: Bound) -> None:
        """Where the rank's bound plan (passes/pipeline_bind.py, what the proof read) runs
        each unit's collectives: its all-gather before the stage op after it, its
        reduce-scatter after the stage op before it, with their divisors."""
        by_name = {u.name: u for u in self.units}
        before: list[tuple[FlatUnit, Op]] = []
        last = None
        for ins in bound.plan.instrs:
            op = ins.op
            if op is None:
                continue
            if op.kind.on_stage:
                self.launch.setdefault(op, []).extend(before)
                before, last = [], op
            elif op.kind is Kind.ALLGATHER:
                before.append((by_name[op.target], op))
            elif op.kind is Kind.REDUCESCATTER:
                assert last is not None, f"{op} before any stage op"
                self.buckets.setdefault(last, []).append([by_name[op.target], ins.divisor, op])
            elif op.kind is Kind.FREE:  # run with the reduce-scatter before it (`_reduce`)
                assert last is not None and self.buckets[last][-1][0].name == op.target, op
                self.buckets[last][-1].append(op)
            elif op.kind is Kind.ALLREDUCE and op.target in by_name:
                self.replicated[op.target] = ins

    def _shard(self, named) -> list[FlatUnit]:
        """This rank's units: each sharded over the shard group (replica d keeps shard d; under
        HSDP the S ranks of its replicate index, `PipeComm.shard` its index there), the
        fp32 shard its own, gathered in the gather dtype. Its units are its bound plan's: a
        stage's, and the tied wte's on the embed's and head's ranks (one layout, so shard d
        is the same slice of wte on both), each laid out in the bound flat order."""
        own, cfg, out = dict(self.named), self.job.model, []
        upcast = self.job.reduce if _wider(self.job.reduce, self.job.gather) else None
        for name, names in named:
            assert all(n in own for n in names), f"unit {name} ({', '.join(names)}) not held"
            spec = UnitSpec(name, tuple(names), (), True, Span.point(1, 1), 0)
            c = self.comm
            unit = FlatUnit(spec, cfg, own, c.shard, c.shards, self.job.gather, upcast)
            out.append(unit)
        return out

    def _readers(self, stage: int) -> list[FlatUnit]:
        """The units stage `stage` computes with (on this rank)."""
        mine = {id(p) for name in self.job.split[stage] for p in self.model.layer_params(name)}
        return [u for u in self.units if any(id(p) in mine for p, *_ in u.layout)]

    def optimizer(self) -> torch.optim.Optimizer:
        return adamw_groups(*_shard_groups(self.units), self.job.optim)

    @property
    def wire(self) -> torch.dtype:
        return self.job.gather or self.job.dtype

    @property
    def counts_norm(self) -> bool:
        """Every rank of a shard group holds its own slice; under HSDP the R ranks of a
        replicate group hold the same (bitwise, after the all-reduce), counted once."""
        m = self.comm.mesh
        return m is None or m.index(self.comm.replica, REPLICATE) == 0

    def begin_step(self) -> None:
        super().begin_step()
        self.gathers, self.gathered = {}, set()

    def before(self, act: Op) -> None:
        """The all-gathers the plan launches before `act`: before the rank's first forward
        of the step, every unit's (torchtitan under PP: reshard_after_forward=False, so each
        is gathered once a step)."""
        for u, op in self.launch.get(act, ()):
            self.issue(op, self.comm.dp)
            full = u.alloc_full()
            shard = u.shard.to(full.dtype)
            work = self._collective(CPUBackend.all_gather(full, shard), (full, shard))
            self.gathers[u] = (work, shard)

    def before_forward(self, stage: int) -> None:
        """The stage's units' gathers waited for."""
        for u in self.readers[stage]:
            if u not in self.gathered:
                assert u in self.gathers, f"unit {u.name} is not gathered this step"
                self.gathers.pop(u)[0].wait()
                self.gathered.add(u)

    def before_backward(self, stage: int) -> None:
        """Before a backward that writes the stage's weights: their .grad are views of each
        unit's unsharded gradient, where autograd accumulates the micro-batches."""
        for u in self.readers[stage]:
            u.grad_buffer(0)

    def after_backward(self, stage: int) -> None:
        """After it: with a reduce dtype wider than the gather's, the micro-batch's gradient
        is added into the unit's accumulator in that dtype (FSDP2's upcast), as the
        reference accumulates in fp32."""
        for u in self.readers[stage]:
            if u.accumulate is not None and 0 in u.grads:
                u.fold(0)

    def _reduce(self, done: list) -> None:
        """Each unit's gradient reduce-scattered into this rank's shard over the shard group
        (its share x / dp in the reduce dtype) and its gathered weights freed; under HSDP the
        shard is then summed over the replicate group, as the DP executor's HSDP does
        (exec/strategies.py `Sharded._replicate`): x / dp summed over S ranks and then over R
        is the mean over all dp = R x S replicas."""
        for unit, divisor, scatter, free in done:
            grad = unit.take_grad(0)
            send = _share(grad, divisor, self.reduce)
            out = torch.empty(unit.shard_len, dtype=self.reduce)
            self.issue(scatter, self.comm.dp, divisor)
            work = self._collective(CPUBackend.reduce_scatter(out, send), (out, send))
            self.issue(free, ())
            unit.release()  # the stage is done with its weights this step

            def land(unit=unit, out=out):
                unit.new_shard_grad().copy_(out)  # cast back into the fp32 gradient shard

            if (replicate := self.replicated.get(unit.name)) is not None:  # HSDP
                self.reductions.append((work, self._replicate(replicate, out, land)))
            else:
                self.reductions.append((work, land))

    def _replicate(self, ins: Instr, out: torch.Tensor, land: Callable[[], None]):
        """HSDP: what lands a reduce-scatter, launched once it is done: its output shard
        all-reduced (summed, each share / the plan's divisor: 1) in place over the replicate
        group, async, landed once that is done."""
        group = self.comm.replicate
        op = ins.op
        assert group is not None and op is not None

        def launch() -> None:
            if ins.divisor != 1:
                out.div_(ins.divisor)
            self.issue(op, group, ins.divisor)
            self.reductions.append((CPUBackend.all_reduce(out)(group), land))

        return launch

    def grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients of this rank's shards (the optimizer's parameters), the tied wte's
        unit summed with its copy's on the other end of the pipeline: shard d of both copies
        is the same slice, so the sum is wte's whole gradient there, both copies get the
        same clipping, AdamW state and update, and stay bitwise equal. The norm counts the
        head's copy's shard not at all."""
        grads: list[torch.Tensor] = []
        counted: list[torch.Tensor] = []
        for u in self.units:
            shard = u.live_shard_grad()
            tied = u.layout[0][0] is self._tied()
            if tied and self.tied is not None:  # this rank holds one end of the pair
                self.sum_tied(shard)
            mine = [p.grad for group in u.optimizer_params() for p in group if p.grad is not None]
            grads += mine
            if not (tied and self.model.holds_tied_copy):
                counted += mine
        return grads, counted

    def after_update(self) -> None:
        for u in self.units:
            u.drop_shard_grad()

    def full_tensors(self, grad: bool) -> dict[str, torch.Tensor]:
        """Each unit's shards all-gathered over the shard group, by parameter name."""
        of_unit: Callable[[FlatUnit], torch.Tensor] = (
            (lambda u: u.live_shard_grad()) if grad else (lambda u: u.shard)
        )
        names = {id(p): n for n, p in self.named}
        out = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=u.dtype)
            shard = of_unit(u).detach()
            self._collective(
                CPUBackend.all_gather(full, shard),
                (full, shard),
            ).wait()
            out.update({names[id(p)]: t for p, t in u.assemble(full).items()})
        return out


def stage_sync(
    job: PipeJob, comm: PipeComm, model: RankModel, stages: list[int], bound: Bound
) -> StageSync:
    """The rank's StageSync, as its bound plan says: FSDP per stage where it holds units,
    else DDP."""
    if bound.units:
        return ShardedStages(job, comm, model, stages, bound)
    return ReplicatedStages(job, comm, model, bound)


def _is_tied(op: Op | None) -> bool:
    """Whether `op` is the sum of the tied wte's two copies (passes/pipeline_bind.py)."""
    return op is not None and op.kind is Kind.ALLREDUCE and op.target == TIED


def _share(grad: torch.Tensor, dp: int, dtype: torch.dtype) -> torch.Tensor:
    """One rank's share of a sum over `dp` replicas that is their mean: x / dp in `dtype`,
    divided in the wider of the two dtypes (the DP executor's rule, exec/strategies.py)."""
    if dp == 1:
        return grad.to(dtype)
    if grad.element_size() >= dtype.itemsize:
        return grad.div_(dp).to(dtype)
    return grad.to(dtype).div_(dp)


def _wider(a: torch.dtype | None, b: torch.dtype | None) -> bool:
    return a is not None and b is not None and a.itemsize > b.itemsize


def _shard_groups(units: list[FlatUnit]) -> tuple[list, list]:
    """AdamW's (decay, no decay) parameters over every unit's shard."""
    decay, plain = [], []
    for u in units:
        d, p = u.optimizer_params()
        decay += d
        plain += p
    return decay, plain

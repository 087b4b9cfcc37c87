"""The pipeline executor: one rank's proven program (passes/pipeline_gen.py) run on its stages.

    ex = PipelineExecutor(job, generated, PipeComm(rank, group, tied_group))
    stats = ex.step()     # one optimizer step over the global batch's m micro-batches

Each item of the rank's program runs in order (`Runner`, one small function a kind):
- F[s]@j: the stage's layers on micro-batch j: tokens on stage 0, else the activation the
  previous stage made (received, or local when that stage is on this rank), detached so the
  stage's backward stops at its input. The last stage makes the loss of its micro-batch.
- B[s]@j: backward of the stage from the output's gradient (received or local), or from
  loss_j / m on the last stage (the reference's accumulation: the mean loss's gradient);
  the input's gradient is kept for SEND_B or the local stage before.
- I[s]@j / W[s]@j (zero bubble): I is the backward to the stage's input only, keeping the
  graph; W the backward to the stage's parameters through that graph (torch's
  stage_backward_input / stage_backward_weight do the same with less recomputation).
- a P2P item, one transfer or a group: `batch_isend_irecv` of its sends and receives,
  posted in the program's order and not waited for there (`transfer`, `Posted`): a receive
  is waited for just before the compute that reads it (`awaited`), a send is dropped once
  complete and waited for at the step's end at the latest, its tensor held until then.
  Untagged, as proven: the transport pairs the k-th send a -> b with the k-th receive.

Why a proven program still runs to its end: `pipeline_check.prove` proves the programs free
of deadlock under a stricter model (a rank runs items one after another; a transfer
completes when both ends are posted, blocking rendezvous; a transfer item ends when its
transfers have), and the executor proves them before it starts. It posts in the proven
order and waits for less: a receive before its reader, which comes after the receive's
item on the rank (a wait the proven graph already implies), a send not before the step's
end. Removing waits, or replacing them by implied ones, keeps the happens-before graph
acyclic, so every item is reached and every transfer has both ends posted; gloo moves the
data on its own threads, so each then completes, the deferred sends included. Where a
transport runs a rank's transfers in issue order on one stream (NCCL), a send still holds
the stream until its receive is posted, whatever the host waits for: that is the blocking
model itself, also proven. passes/pipeline_sim.py times this executor (`Waits.LAZY`).

After the program, the update (`update`): the tied embedding's two copies (first stage's
embed, last stage's head) get the sum of their gradients by an all-reduce on the 2-rank
group of those ranks, as Megatron all-reduces its "embedding group"; the global gradient
norm is the square root of the all-reduced sum of each rank's squared norms, the tied
weight counted once (on the embed's rank); clipping by it; then AdamW with the reference's
groups and kernels (model/reference.py make_adamw) at the spec's learning-rate schedule.
Both copies of wte see the same gradient, state and step, so they stay bitwise equal.

DP x PP (`replicas` > 1): the pipeline is replicated, ranks laid out pp-outermost (global rank
= pipeline rank x dp + replica, ir/spec.py PipelineSpec); replica d runs micro-batch j of the
slice the DP executor gives rank d of dp at micro-step j (model/batching.py sequence_ids),
so the replicas together read the global batch once. Each stage's gradients are all-reduced
over the ranks holding it in every replica (`PipeComm.dp`) in one flat bucket, launched
right after the program's last B or W of that stage (pipelining's REDUCE_GRAD: a DDP with
one bucket a stage; DDP buckets per stage are not built) as each rank's x / dp, and waited
for before the update. The tied all-reduce then runs within each replica; the norm is
replica 0's pipeline ranks' sum (the other replicas add zeros: after the reduction their
gradients are bitwise replica 0's), in the same all-reduce over every rank as the losses,
whose sum over m x dp micro-batches is the global mean.

FSDP per stage (`PipeJob.units`, torchtitan's FSDP2 under PP): each unit lies in one stage
and is a FlatUnit (exec/flat.py) sharded over the dp group. Every unit's all-gather is
launched at the rank's first F of the step and waited for before its stage's first F; the
unit stays gathered through the step (reshard_after_forward=False), its micro-batches'
gradients accumulate in one unsharded buffer (folded into the reduce dtype when that is
wider than the gather's: FSDP2's upcast), and after the stage's last B or W it is
reduce-scattered (async, waited for before the update) and freed. AdamW steps the shards;
the norm sums every rank's shards. The tied wte is a unit of its own on both ends, one
layout, so the tied all-reduce sums the same slice on each replica's pair.

Numerics (`PipeJob.compute/gather/reduce`, the schedule's precision policy): autocast in the
compute dtype around each forward, units gathered in the gather dtype, dp reductions in the
reduce dtype; P2P carries the residual stream in the dtype of the weights the layers
compute with (`wire`), and each send asserts it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from schedc.analysis.pipeline_trace import ItemSpan
from schedc.errors import RunError
from schedc.exec.backends import DONE, copy_alone
from schedc.exec.cpu_backend import CPUBackend
from schedc.exec.flat import FlatUnit
from schedc.exec.options import StepStats
from schedc.exec.pipeline_model import RankModel, check_split
from schedc.ir.pipeline import Action, Item, Kind, Pipeline, format_item, reader
from schedc.ir.source import Span
from schedc.ir.spec import UnitSpec
from schedc.lang.diagnostics import CompileError
from schedc.model.arch import GPTConfig
from schedc.model.config import OptimConfig
from schedc.model.data import GlobalBatches
from schedc.model.reference import adamw_groups, clip_coef, make_adamw
from schedc.passes.pipeline_check import prove
from schedc.passes.pipeline_gen import Generated


@dataclass(frozen=True)
class PipeJob:
    """What every pipeline rank trains: the model, its stages, the data and the optimizer."""

    model: GPTConfig
    split: tuple[tuple[str, ...], ...]
    """Layers of each stage, contiguous, embed .. head (exec/pipeline_model.py split_layers)."""
    batches: GlobalBatches
    """The global batch of each step; micro-batch j is its j-th of m equal slices."""
    optim: OptimConfig
    steps: int
    """The run's steps (the learning-rate schedule's horizon)."""
    seed: int
    dtype: torch.dtype = torch.float32
    units: tuple[tuple[str, ...], ...] | None = None
    """FSDP per stage: each unit's parameters (every one of the model once, each unit inside
    one stage, wte.weight alone in its unit: the head's copy is sharded like it); None: each
    stage's gradients are all-reduced in one bucket (DDP)."""
    compute: torch.dtype | None = None  # the autocast dtype of forward; None: `dtype`
    gather: torch.dtype | None = None  # what FSDP units are gathered and computed in
    reduce: torch.dtype | None = None  # what gradients are all-reduced or reduce-scattered in


@dataclass
class PipeComm:
    """This rank's place: its pipeline rank, its replica's pipeline group (P2P and the
    norm), the group of its replica's first and last stage's ranks (the tied embedding; None
    when one rank holds both) and, with dp > 1 replicas, the group of the ranks holding its
    stages in every replica and the group of every rank (the loss and the norm)."""

    rank: int  # pipeline rank
    group: dist.ProcessGroup | None = None  # None: the default group
    tied: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None  # None: one replica
    replica: int = 0
    replicas: int = 1
    world: dist.ProcessGroup | None = None  # None: the default group


def make_comm(rank: int, world: int, pipe: Pipeline) -> PipeComm:
    """Global `rank`'s PipeComm in a job of `world` = pp x dp ranks, pp-outermost. Every rank
    makes every group, in the same order (`dist.new_group` is collective over the default
    group): each replica's pipeline group and tied pair, then each pipeline rank's dp group."""
    dp = world // pipe.pp
    assert dp * pipe.pp == world, f"world {world} is not {pipe.pp} pipeline ranks x dp"
    pp_rank, replica = divmod(rank, dp)
    first, last = pipe.rank_of(0), pipe.rank_of(pipe.stages - 1)
    mine = PipeComm(pp_rank, replica=replica, replicas=dp)
    for d in range(dp):
        ranks = [p * dp + d for p in range(pipe.pp)]
        group = dist.new_group(ranks) if dp > 1 else None
        tied = dist.new_group([ranks[first], ranks[last]]) if first != last else None
        if d == replica:
            mine.group, mine.tied = group, tied
    for p in range(pipe.pp if dp > 1 else 0):
        group = dist.new_group([p * dp + d for d in range(dp)])
        if p == pp_rank:
            mine.dp = group
    return mine


@dataclass
class Flight:
    """One step's tensors in flight, by (stage, micro-batch), each dropped once used."""

    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    received: dict[Action, torch.Tensor] = field(default_factory=dict)
    weights: dict[tuple[int, int], tuple] = field(default_factory=dict)  # I done, W to come
    losses: list[torch.Tensor] = field(default_factory=list)
    reductions: list[tuple] = field(default_factory=list)  # (work, what to do once it is done)
    gathers: dict[int, tuple] | None = None  # unit index -> (work, shard sent); None: not yet


class PipelineExecutor:
    """Runs one rank's program of a proven pipeline schedule, step after step."""

    def __init__(
        self,
        job: PipeJob,
        generated: Generated,
        comm: PipeComm,
        record: bool = False,
        timed: bool = False,
    ):
        pipe, programs = generated.pipeline, generated.programs
        check_split(job.model, job.split)
        if len(job.split) != pipe.stages:
            raise ValueError(f"{len(job.split)} stages split, the schedule has {pipe.stages}")
        if job.batches.global_seqs % (pipe.microbatches * comm.replicas):
            raise ValueError(
                f"{job.batches.global_seqs} sequences do not split into {pipe.microbatches} "
                f"equal micro-batches on each of {comm.replicas} replicas"
            )
        proof = prove(pipe, programs)
        if not proof.ok:
            raise CompileError([f.diagnostic for f in proof.findings])
        self.job, self.pipe, self.comm, self.record = job, pipe, comm, record
        self.program: list[Item] = programs[comm.rank]
        self.stages = pipe.stages_of(comm.rank)
        layers = [name for s in self.stages for name in job.split[s]]
        self.model = RankModel(job.model, layers, job.seed, job.dtype)
        self.named = list(self.model.named_parameters())
        self.units = self._shard() if job.units is not None else []
        self.readers = {s: self._readers(s) for s in self.stages}
        self.optimizer = (
            adamw_groups(*_shard_groups(self.units), job.optim)
            if self.units
            else make_adamw(self.named, job.optim)
        )
        self.micro = job.batches.global_seqs // (pipe.microbatches * comm.replicas)
        self.peers = [_global_rank(comm.group, r) for r in range(pipe.pp)]
        self.buckets = self._buckets() if comm.replicas > 1 or self.units else {}
        self.reduce = job.reduce or job.dtype
        # what P2P carries: the residual stream, in the dtype of the weights the layers
        # compute with (autocast's bf16 branches are added to it in its own dtype)
        self.wire = (job.gather or job.dtype) if self.units else job.dtype
        self.step_index = 0
        self.reads = awaited(self.program)
        self.posted = Posted()
        self.rank = comm.rank * comm.replicas + comm.replica  # global
        self.spans: list[ItemSpan] | None = [] if timed else None
        """With `timed`: each item's start and end, every step (perf_counter: the host's
        monotonic clock, one for its ranks), for a trace (analysis/pipeline_trace.py)."""

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        flight = Flight()
        spans, i = self.spans, 0
        try:  # one handler for the program: the failing item is `i`
            for i, item in enumerate(self.program):
                for recv in self.reads[i]:  # what this compute reads, received: waited now
                    self.posted.wait_recv(recv)
                start = time.perf_counter() if spans is not None else 0.0
                with _range(item):
                    self.run_item(item, flight)
                if spans is not None:  # a compute's start is after its receive arrived
                    end = time.perf_counter()
                    spans.append(ItemSpan(self.rank, self.step_index, i, start, end))
            self.posted.drain()
        except Exception as e:
            raise RunError(
                f"pipeline rank {self.comm.rank}, step {self.step_index}: "
                f"{type(e).__name__}: {e}\n{self.render(i)}"
            ) from e
        left = flight.inputs or flight.received or flight.grads_in or flight.weights
        assert not left, "tensors left over after the program"
        self._wait_reductions(flight)
        stats = self.update(flight.losses)
        stats.dt_ms = (time.perf_counter() - t0) * 1e3
        tokens = self.job.batches.global_seqs * self.job.batches.seq_len
        stats.tokens_per_s = tokens / max(stats.dt_ms / 1e3, 1e-9)
        self.step_index += 1
        return stats

    def render(self, failed: int) -> str:
        """The rank's program, one item a line, the failing one marked."""
        lines = [f"{i:>4} {format_item(it)}" for i, it in enumerate(self.program)]
        lines[failed] += "   <-- ERROR HERE"
        return "\n".join(lines)

    def run_item(self, item: Item, flight: Flight) -> None:
        if item[0].kind.is_p2p:
            self.transfer(item, flight)
            return
        (act,) = item
        RUN[act.kind](self, act, flight)
        if bucket := self.buckets.get(act):
            self._reduce(bucket, flight)

    # -- data parallelism across replicas ----------------------------------------------------

    def _buckets(self) -> dict[Action, list]:
        """What each action completes: the parameters (DDP) or units (FSDP) whose gradients
        no later action writes, keyed by that action (a stage's last B or W)."""
        owner = self._last_writers()
        out: dict[Action, list] = {}
        if self.units:  # a unit is done with its last parameter
            for u in self.units:
                _, act = max(owner[id(p)] for p, *_ in u.layout)
                out.setdefault(act, []).append(u)
            return out
        for _, p in self.named:
            out.setdefault(owner[id(p)][1], []).append(p)
        return out

    def _last_writers(self) -> dict[int, tuple[int, Action]]:
        """Each parameter's last writer in the program, by id: (its index, the action); the
        tied wte, in two stages where one rank holds both, goes with the later one."""
        last: dict[int, Action] = {}
        for item in self.program:
            for act in item:
                if act.kind in (Kind.B, Kind.W):
                    last[act.stage] = act
        index = {a: i for i, item in enumerate(self.program) for a in item}
        owner: dict[int, tuple[int, Action]] = {}
        for s, act in last.items():
            for name in self.job.split[s]:
                for p in self._params(name):
                    owner[id(p)] = max(owner.get(id(p), (-1, act)), (index[act], act))
        return owner

    def _reduce(self, done: list, flight: Flight) -> None:
        """The gradients `done` completes, summed over the replicas, launched now (nothing
        after this action writes them: pipelining's REDUCE_GRAD), waited for in
        `_wait_reductions` before the update: a flat bucket all-reduced (DDP), or each unit's
        gradient reduce-scattered into this rank's shard and its gathered weights freed
        (FSDP). Each rank's share is x / dp before the sum, in the reduce dtype (the DP
        executor's order: the division in the wider dtype)."""
        if self.units:
            for u in done:
                self._reduce_scatter(u, flight)
            return
        grads = [p.grad for p in done]
        assert all(g is not None for g in grads), "a bucket's gradient was never written"
        flat = torch._utils._flatten_dense_tensors(grads)
        send = _share(flat, self.comm.replicas, self.reduce)
        work = self._collective(lambda pg: dist.all_reduce(send, group=pg, async_op=True))

        def land(send=send, flat=flat, grads=grads):
            flat.copy_(send)  # a no-op view copy when no cast
            for g, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(mean)

        flight.reductions.append((work, land))

    def _reduce_scatter(self, unit: FlatUnit, flight: Flight) -> None:
        grad = unit.take_grad(0)
        send = _share(grad, self.comm.replicas, self.reduce)
        out = torch.empty(unit.shard_len, dtype=self.reduce)
        work = self._collective(CPUBackend.reduce_scatter(out, send), (out, send))
        unit.release()  # the stage is done with its weights this step

        def land(unit=unit, out=out):
            unit.new_shard_grad().copy_(out)  # cast back into the fp32 gradient shard

        flight.reductions.append((work, land))

    def _collective(self, launch, copy: tuple | None = None):
        """`launch` on the dp group, async; one replica: nothing to send (a copy, if given)."""
        if self.comm.replicas > 1:
            return launch(self.comm.dp)
        if copy is not None:
            copy_alone(*copy)
        return DONE

    def _wait_reductions(self, flight: Flight) -> None:
        for work, land in flight.reductions:
            work.wait()
            land()

    # -- FSDP per stage ----------------------------------------------------------------------

    def _shard(self) -> list[FlatUnit]:
        """This rank's units: each sharded over the replicas (replica d keeps shard d), the
        fp32 shard its own, gathered in the gather dtype. Its own units are those whose
        parameters it holds: a stage's, and the tied wte's on the embed's and head's ranks
        (one layout, so shard d is the same slice of wte on both)."""
        assert self.job.units is not None
        own, cfg, out = dict(self.named), self.job.model, []
        upcast = self.job.reduce if _wider(self.job.reduce, self.job.gather) else None
        for i, names in enumerate(self.job.units):
            held = [n in own for n in names]
            if not any(held):
                continue
            assert all(held), f"unit {i} ({', '.join(names)}) lies across ranks"
            spec = UnitSpec(f"u{i}", tuple(names), (), True, Span.point(1, 1), 0)
            unit = FlatUnit(
                spec, cfg, own, self.comm.replica, self.comm.replicas, self.job.gather, upcast
            )
            out.append(unit)
        return out

    def _readers(self, stage: int) -> list[FlatUnit]:
        """The units stage `stage` computes with (on this rank)."""
        mine = {id(p) for name in self.job.split[stage] for p in self._params(name)}
        return [u for u in self.units if any(id(p) in mine for p, *_ in u.layout)]

    def _unshard(self, stage: int, flight: Flight) -> None:
        """Before a stage's forward: at the rank's first forward of the step every unit's
        all-gather is launched (torchtitan under PP: reshard_after_forward=False, so each
        is gathered once a step), and the stage's own are waited for."""
        if flight.gathers is None:
            flight.gathers = {}
            for i, u in enumerate(self.units):
                full = u.alloc_full()
                shard = u.shard.to(full.dtype)
                work = self._collective(
                    CPUBackend.all_gather(full, shard),
                    (full, shard),
                )
                flight.gathers[i] = (work, shard)
        for u in self.readers[stage]:
            if (g := flight.gathers.pop(self.units.index(u), None)) is not None:
                g[0].wait()

    def _bind_grads(self, stage: int) -> None:
        """Before a backward that writes the stage's weights: their .grad are views of each
        unit's unsharded gradient, where autograd accumulates the micro-batches."""
        for u in self.readers[stage]:
            u.grad_buffer(0)

    def _fold_grads(self, stage: int) -> None:
        """After it: with a reduce dtype wider than the gather's, the micro-batch's gradient
        is added into the unit's accumulator in that dtype (FSDP2's upcast), as the
        reference accumulates in fp32."""
        for u in self.readers[stage]:
            if u.accumulate is not None and 0 in u.grads:
                u.fold(0)

    # -- compute -----------------------------------------------------------------------------

    def forward(self, act: Action, flight: Flight) -> None:
        s, j = act.stage, act.mb
        last = s == self.pipe.stages - 1
        x, y = self.job.batches.micro_batch(
            self.step_index, self.comm.replica, j, self.micro, self.comm.replicas
        )
        if s > 0:
            x = self._input(act, flight).detach().requires_grad_()
        flight.inputs[(s, j)] = x
        if self.units:
            self._unshard(s, flight)
        with self._autocast():
            out = self.model.run(self.job.split[s], x, y if last else None)
        if last:
            flight.losses.append(out.detach())
            out = out / self.pipe.microbatches  # the reference's loss_j / k
        flight.outputs[(s, j)] = out

    def _input(self, act: Action, flight: Flight) -> torch.Tensor:
        s, j = act.stage, act.mb
        if self.pipe.local(s - 1, s):
            return flight.outputs[(s - 1, j)]
        return flight.received.pop(Action(Kind.RECV_F, s, j))

    def _grad_out(self, act: Action, flight: Flight) -> torch.Tensor | None:
        s, j = act.stage, act.mb
        if s == self.pipe.stages - 1:
            return None  # the loss: its gradient is 1
        if self.pipe.local(s + 1, s):
            return flight.grads_in.pop((s + 1, j))
        return flight.received.pop(Action(Kind.RECV_B, s, j))

    def backward(self, act: Action, flight: Flight) -> None:
        key = (act.stage, act.mb)
        out, grad = flight.outputs.pop(key), self._grad_out(act, flight)
        self._bind_grads(act.stage)
        torch.autograd.backward(out, grad)
        self._fold_grads(act.stage)
        self._keep_input_grad(key, flight.inputs.pop(key), flight)

    def backward_input(self, act: Action, flight: Flight) -> None:
        """I: the input's gradient only, the graph kept for W (stage 0 has no input to
        differentiate: its W does the whole backward)."""
        key = (act.stage, act.mb)
        out, grad, inp = (
            flight.outputs.pop(key),
            self._grad_out(act, flight),
            flight.inputs.pop(key),
        )
        if act.stage > 0:
            torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
            self._keep_input_grad(key, inp, flight)
        flight.weights[key] = (out, grad)

    def backward_weight(self, act: Action, flight: Flight) -> None:
        """W: the parameters' gradients, through the graph I kept."""
        out, grad = flight.weights.pop((act.stage, act.mb))
        params = {id(p): p for name in self.job.split[act.stage] for p in self._params(name)}
        self._bind_grads(act.stage)
        torch.autograd.backward(out, grad, inputs=list(params.values()))
        self._fold_grads(act.stage)

    def _autocast(self):
        """The compute dtype's autocast around a forward (the DP executor's
        `autocast_forward`); backward runs outside it, in the dtypes autocast chose."""
        if self.job.compute is None or self.job.compute == self.job.dtype:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.job.compute)

    def _keep_input_grad(self, key: tuple[int, int], inp: torch.Tensor, flight: Flight) -> None:
        if key[0] > 0:
            assert inp.grad is not None
            flight.grads_in[key] = inp.grad

    def _params(self, layer: str) -> list[torch.nn.Parameter]:
        own = dict(self.named)
        return [own[spec.name] for spec in self.job.model.layer_params(layer)] + (
            [own["wte.weight"]] if layer == "head" else []
        )

    # -- communication -----------------------------------------------------------------------

    def transfer(self, item: Item, flight: Flight) -> None:
        """A send, a receive or a group of them, posted together (`batch_isend_irecv`, in
        the program's order) and not waited for here: a receive is waited for by the
        compute that reads it (`self.reads`), a send once done or at the step's end
        (`Posted`; the module docstring says why the proof still holds)."""
        ops, kinds = [], []
        for act in item:
            peer = self.peers[self.pipe.peer(act)]
            if act.kind.is_send:
                tensor = self._payload(act, flight)
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.comm.group))
            else:
                tensor = torch.empty(self._shape(), dtype=self.wire)
                flight.received[act] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.comm.group))
            kinds.append((act, tensor))
        self.posted.add(kinds, dist.batch_isend_irecv(ops))

    def _payload(self, send: Action, flight: Flight) -> torch.Tensor:
        key = (send.stage, send.mb)
        if send.kind is Kind.SEND_F:
            out = flight.outputs[key].detach().contiguous()
        else:
            out = flight.grads_in.pop(key).contiguous()
        assert out.dtype == self.wire, f"{send}: {out.dtype} where the peer receives {self.wire}"
        return out

    def _shape(self) -> tuple[int, int, int]:
        return (self.micro, self.job.batches.seq_len, self.job.model.n_embd)  # (B, T, C)

    # -- the update --------------------------------------------------------------------------

    def update(self, losses: list[torch.Tensor]) -> StepStats:
        """Tied gradients summed, global norm, clipping, AdamW; the step's loss and norm."""
        job, opt, c = self.job, self.job.optim, self.comm
        grads, counted = self._sharded_grads() if self.units else self._replicated_grads()
        sq = torch.stack(torch._foreach_norm(counted)).square().sum() if counted else None
        totals = torch.zeros(2, dtype=torch.float64)
        # replicated: replica 0's squares (every replica's gradients are bitwise its);
        # sharded: every rank's, each holding its own slice
        mine = sq is not None and (self.units or not c.replica)
        totals[0] = sq.double() if mine and sq is not None else 0.0
        totals[1] = torch.stack(losses).double().sum() if losses else 0.0
        dist.all_reduce(totals, group=c.group if c.replicas == 1 else c.world)
        norm = totals[0].sqrt().to(job.dtype)
        lr = opt.lr_at(self.step_index, job.steps)
        stats = StepStats(self.step_index, 0.0, lr, 0.0, 0.0, 0.0)
        if self.record:
            stats.grads = self._full(lambda u: u.live_shard_grad(), lambda p: p.grad)
        if opt.clip > 0:
            torch._foreach_mul_(grads, clip_coef(norm, opt.clip))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.record:
            stats.params = self._full(lambda u: u.shard, lambda p: p)
        for u in self.units:
            u.drop_shard_grad()
        stats.loss = (totals[1] / (self.pipe.microbatches * self.comm.replicas)).item()
        stats.grad_norm = norm.item()
        return stats

    def _replicated_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every parameter's gradient, the tied copies' summed by an all-reduce on the pair
        of ranks holding them (embed's part + head's part); and those the norm counts (the
        tied weight once, on the embed's rank)."""
        wte = dict(self.named).get("wte.weight")
        if self.comm.tied is not None and wte is not None:
            assert wte.grad is not None
            dist.all_reduce(wte.grad, group=self.comm.tied)
        grads = [p.grad for _, p in self.named if p.grad is not None]
        assert len(grads) == len(self.named), "a parameter the loss does not reach"
        counted = [g for (n, _), g in zip(self.named, grads) if not self._tied_copy(n)]
        return grads, counted

    def _sharded_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients of this rank's shards (the optimizer's parameters), the tied wte's
        unit summed with its copy's on the other end of the pipeline: shard d of both copies
        is the same slice, so the sum is wte's whole gradient there, both copies get the
        same clipping, AdamW state and update, and stay bitwise equal. The norm counts the
        head's copy's shard not at all."""
        grads: list[torch.Tensor] = []
        counted: list[torch.Tensor] = []
        for u in self.units:
            shard = u.live_shard_grad()
            tied = u.layout[0][0] is dict(self.named).get("wte.weight")
            if tied and self.comm.tied is not None:
                dist.all_reduce(shard, group=self.comm.tied)
            mine = [p.grad for group in u.optimizer_params() for p in group if p.grad is not None]
            grads += mine
            if not (tied and self.model.holds_tied_copy):
                counted += mine
        return grads, counted

    def _full(self, of_unit, of_param) -> dict[str, torch.Tensor]:
        """Whole tensors by name, for tests: a unit's shards all-gathered over the replicas
        (`of_unit`), or each replicated parameter's (`of_param`)."""
        if not self.units:
            return {n: of_param(p).detach().clone() for n, p in self.named}
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

    def _tied_copy(self, name: str) -> bool:
        return name == "wte.weight" and self.model.holds_tied_copy


RUN = {
    Kind.F: PipelineExecutor.forward,
    Kind.B: PipelineExecutor.backward,
    Kind.I: PipelineExecutor.backward_input,
    Kind.W: PipelineExecutor.backward_weight,
}


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


def _global_rank(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


# -- posted transfers and item timings ---------------------------------------------------------


def awaited(program: list[Item]) -> list[tuple[Action, ...]]:
    """Per item, the receives of the program it reads (ir/pipeline.py `reader`): what the
    executor waits for before running it, and passes/pipeline_sim.py's lazy model too."""
    split = any(a.kind is Kind.I for item in program for a in item)
    by_reader = {
        reader(a, Kind.I if split else Kind.B): a
        for item in program
        for a in item
        if a.kind.is_p2p and not a.kind.is_send
    }
    return [
        (by_reader[item[0]],) if not item[0].kind.is_p2p and item[0] in by_reader else ()
        for item in program
    ]


class Posted:
    """The transfers posted and not yet waited for. A receive is waited for when its reader
    runs; a send, with the tensor it reads kept alive, is dropped once complete (checked
    whenever more are posted) and waited for at the step's end at the latest."""

    def __init__(self) -> None:
        self.recvs: dict[Action, dist.Work] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def add(self, posted: list[tuple[Action, torch.Tensor]], works: list) -> None:
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        if len(works) != len(posted):  # one work for the group (a coalescing backend)
            works = works * len(posted)
        for (act, tensor), work in zip(posted, works):
            if act.kind.is_send:
                self.sends.append((work, tensor))
            else:
                self.recvs[act] = work

    def wait_recv(self, recv: Action) -> None:
        self.recvs.pop(recv).wait()

    def drain(self) -> None:
        assert not self.recvs, f"receives never read: {sorted(map(str, self.recvs))}"
        for work, _ in self.sends:
            work.wait()
        self.sends = []


def _range(item: Item):
    """A profiler range named by the item's IR text, when a profiler is listening (else
    nothing: a record_function costs a few microseconds an item)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(format_item(item))

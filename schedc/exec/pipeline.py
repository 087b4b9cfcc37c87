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
one bucket a stage; buckets or FSDP units per stage are not built) and waited for before the
update, then divided by dp. The tied all-reduce then runs within each replica; the norm is
replica 0's pipeline ranks' sum (the other replicas add zeros: after the reduction their
gradients are bitwise replica 0's), in the same all-reduce over every rank as the losses,
whose sum over m x dp micro-batches is the global mean.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from schedc.analysis.pipeline_trace import ItemSpan
from schedc.errors import RunError
from schedc.exec.options import StepStats
from schedc.exec.pipeline_model import RankModel, check_split
from schedc.ir.pipeline import Action, Item, Kind, Pipeline, format_item, reader
from schedc.lang.diagnostics import CompileError
from schedc.model.arch import GPTConfig
from schedc.model.config import OptimConfig
from schedc.model.data import GlobalBatches
from schedc.model.reference import clip_coef, make_adamw
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
    reductions: list[tuple] = field(default_factory=list)  # (work, flat bucket, its grads)


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
        self.optimizer = make_adamw(self.named, job.optim)
        self.micro = job.batches.global_seqs // (pipe.microbatches * comm.replicas)
        self.peers = [_global_rank(comm.group, r) for r in range(pipe.pp)]
        self.buckets = self._buckets() if comm.replicas > 1 else {}
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

    def _buckets(self) -> dict[Action, list[torch.nn.Parameter]]:
        """Each stage's parameters, keyed by the program's last action writing their
        gradients (its last B or W); the tied wte, in two stages where one rank holds both,
        goes with the later one."""
        last: dict[int, Action] = {}
        for item in self.program:
            for act in item:
                if act.kind in (Kind.B, Kind.W):
                    last[act.stage] = act
        owner: dict[int, tuple[int, Action, torch.nn.Parameter]] = {}
        index = {a: i for i, item in enumerate(self.program) for a in item}
        for s, act in last.items():
            for name in self.job.split[s]:
                for p in self._params(name):
                    if id(p) not in owner or owner[id(p)][0] < index[act]:
                        owner[id(p)] = (index[act], act, p)
        out: dict[Action, list[torch.nn.Parameter]] = {}
        for _, act, p in owner.values():
            out.setdefault(act, []).append(p)
        return out

    def _reduce(self, params: list[torch.nn.Parameter], flight: Flight) -> None:
        """The bucket's gradients summed over the replicas, launched now, waited for in
        `update` (its gradients are final: nothing after this action writes them)."""
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads), "a bucket's gradient was never written"
        flat = torch._utils._flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.comm.dp, async_op=True)
        flight.reductions.append((work, flat, grads))

    def _wait_reductions(self, flight: Flight) -> None:
        for work, flat, grads in flight.reductions:
            work.wait()
            flat.div_(self.comm.replicas)
            for g, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(mean)

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
        torch.autograd.backward(out, grad)
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
        torch.autograd.backward(out, grad, inputs=list(params.values()))

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
                tensor = torch.empty(self._shape(), dtype=self.job.dtype)
                flight.received[act] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.comm.group))
            kinds.append((act, tensor))
        self.posted.add(kinds, dist.batch_isend_irecv(ops))

    def _payload(self, send: Action, flight: Flight) -> torch.Tensor:
        key = (send.stage, send.mb)
        if send.kind is Kind.SEND_F:
            return flight.outputs[key].detach().contiguous()
        return flight.grads_in.pop(key).contiguous()

    def _shape(self) -> tuple[int, int, int]:
        return (self.micro, self.job.batches.seq_len, self.job.model.n_embd)  # (B, T, C)

    # -- the update --------------------------------------------------------------------------

    def update(self, losses: list[torch.Tensor]) -> StepStats:
        """Tied gradients summed, global norm, clipping, AdamW; the step's loss and norm."""
        job, opt = self.job, self.job.optim
        wte = dict(self.named).get("wte.weight")
        if self.comm.tied is not None and wte is not None:
            assert wte.grad is not None
            dist.all_reduce(wte.grad, group=self.comm.tied)  # embed's part + head's part
        grads = [p.grad for _, p in self.named if p.grad is not None]
        assert len(grads) == len(self.named), "a parameter the loss does not reach"
        counted = [g for (n, p), g in zip(self.named, grads) if not self._tied_copy(n)]
        sq = torch.stack(torch._foreach_norm(counted)).square().sum() if counted else None
        totals = torch.zeros(2, dtype=torch.float64)
        totals[0] = 0.0 if sq is None or self.comm.replica else sq.double()  # replica 0's
        totals[1] = torch.stack(losses).double().sum() if losses else 0.0
        c = self.comm
        dist.all_reduce(totals, group=c.group if c.replicas == 1 else c.world)
        norm = totals[0].sqrt().to(grads[0].dtype)
        lr = opt.lr_at(self.step_index, job.steps)
        stats = StepStats(self.step_index, 0.0, lr, 0.0, 0.0, 0.0)
        if self.record:
            stats.grads = {n: p.grad.detach().clone() for n, p in self.named if p.grad is not None}
        if opt.clip > 0:
            torch._foreach_mul_(grads, clip_coef(norm, opt.clip))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.record:
            stats.params = {n: p.detach().clone() for n, p in self.named}
        stats.loss = (totals[1] / (self.pipe.microbatches * self.comm.replicas)).item()
        stats.grad_norm = norm.item()
        return stats

    def _tied_copy(self, name: str) -> bool:
        return name == "wte.weight" and self.model.holds_tied_copy


RUN = {
    Kind.F: PipelineExecutor.forward,
    Kind.B: PipelineExecutor.backward,
    Kind.I: PipelineExecutor.backward_input,
    Kind.W: PipelineExecutor.backward_weight,
}


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

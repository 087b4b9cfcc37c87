"""A pipeline rank of the proof (passes/prove.py): the stage ops of ir/op.py executed
abstractly beside the data-parallel ones, in the one prover.

What a pipeline rank's buffers hold (`_Buf.value`), per micro-batch j of a stage s:

    act[s]@mbj     F[s]@j's output: the (rank, micro-batch) whose sequences entered stage 0,
                   and the step it was computed in
    grad[s]@mbj    B[s]@j's or I[s]@j's input gradient, for the stage below: that
                   (rank, micro-batch) and the weight of its loss (the last stage's loss scale)
    keep[s]@mbj    I[s]@j's kept gradient, for its W
    RECV_F[s]@mbj  a receive's buffer: pending until its send is matched, then the send's
    RECV_B[s]@mbj  value (a transfer is matched by FIFO order on its communicator and pair of
                   ranks, as the transport pairs them, and must carry what the receive names)

A backward adds its micro-batch's key at its weight into the gradient of every parameter its
stage's layers write, through each layer (passes/values.py): the key comes from the value
that reached it, not from its name, so a program that feeds a stage another micro-batch, or a
backward another micro-batch's gradient, trains on what it read, and the theorem at the
update says so. The stage's buckets are then reduced over the replicas and the tied copies
summed over their pair of ranks (passes/pipeline_bind.py), as any collective of the prover.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from schedc.ir.op import Kind, Op, stage_op
from schedc.passes.pipeline_memory import stage_params
from schedc.passes.prove_rank import At, Refuted, _Issue, _Rank
from schedc.passes.values import EMPTY

Data = tuple[int, int]  # (rank, micro-batch) whose sequences a micro-batch's tensors carry


class StageRank(_Rank):
    """One pipeline rank: its program's stage ops, and the plan's collectives and update."""

    def __init__(self, prover: Any, bound):
        super().__init__(prover, bound)
        ps = prover.spec.pipeline
        self.layers = [st.layers for st in ps.stages]
        self.pipe = ps.pipeline(prover.spec.accum)
        held = set(self.held)  # FSDP per stage: the units of its parameters (both tied ends)
        self._holds_its_stages(bound)
        self.units = [u for u, pieces in prover.layout.items() if {p for p, *_ in pieces} <= held]

    def _holds_its_stages(self, bound) -> None:
        """The parameters the rank updates (`Bound.params`) are exactly those its stages'
        layers compute with: the executor updates its stages' parameters, the proof these."""
        stages = {i.op.stage for i in bound.plan.instrs if i.op is not None and i.op.kind.on_stage}
        want = {p for s in stages for p in stage_params(self.spec, s)}
        if set(self.held) != want:
            odd = sorted(want ^ set(self.held))
            raise self.fail(
                None,
                f"rank {self.rank} is bound to update {len(self.held)} parameters, but its "
                f"stages {', '.join(map(str, sorted(stages)))} compute with {len(want)}: "
                f"{', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''} in one and not the other",
            )

    def run(self, ins, at: At) -> None:
        op = ins.op
        if not op.kind.on_stage:
            return super().run(ins, at)
        if not op.kind.is_p2p:
            self.read_gathered(op, at)  # FSDP: the stage's units, gathered since the update
        if op.kind is Kind.F:
            self.forward(op, at)
        elif op.kind in (Kind.B, Kind.I):
            self.backward_input(op, at)
        elif op.kind is Kind.W:
            name = f"keep[{op.stage}]@mb{op.mb}"
            data, weight = self.current(op, name, self.take(name, at), at)
            self.add_grads(op, data, weight, at)
        elif op.kind.is_send:
            self.send(ins, at)
        else:
            buf = self.write(_recv(op), at)
            buf.pending, buf.writes, buf.reads = True, {at[0]: at}, {}
            self.p.issue(_Issue(self.rank, at[2], ins, at), f"{op.comm}:transfers")

    # -- compute -------------------------------------------------------------------------

    def forward(self, op: Op, at: At) -> None:
        s, j = op.stage, op.mb
        if s == 0:
            data: Data = (self.rank, j)
        elif self.pipe.local(s - 1, s):
            name = f"act[{s - 1}]@mb{j}"
            data = self.current(op, name, self.read(name, at), at)
        else:
            data = self.current(op, _recv(op), self.take(_recv(op), at), at)
        if s == self.pipe.stages - 1:
            self.targets(op, data, at)
        self.write(f"act[{s}]@mb{j}", at).value = (data, self.started)
        self.done[op] = at

    def targets(self, op: Op, data: Data, at: At) -> None:
        """The last stage's loss reads its targets at its own slice of the batch, which must
        be the slice whose tokens its input carries."""
        mine, theirs = self.bound.positions(op.mb), self.p.bounds[data[0]].positions(data[1])
        if mine != theirs:
            raise self.fail(
                at[2],
                f"{op} takes its loss against the targets of positions {_span(mine)} of the "
                f"step's batch, but its input carries the tokens of {_data(data)}, positions "
                f"{_span(theirs)}",
            )

    def backward_input(self, op: Op, at: At) -> None:
        """B or I: the stage's output and the gradient that reaches it, the input gradient
        made for the stage below (kept for W by I, the parameters' gradients added by B)."""
        s, j = op.stage, op.mb
        data = self.current(op, f"act[{s}]@mb{j}", self.take(f"act[{s}]@mb{j}", at), at)
        if s == self.pipe.stages - 1:
            weight = self.bound.loss_scale  # the last stage's loss, scaled
        else:
            src = f"grad[{s + 1}]@mb{j}" if self.pipe.local(s + 1, s) else _recv(op)
            back, weight = self.current(op, src, self.take(src, at), at)
            if back != data:
                raise self.fail(
                    at[2],
                    f"{op} back-propagates the gradient of {_data(back)} through the forward "
                    f"of {_data(data)}: the stage mixes two micro-batches",
                )
        if s > 0:
            self.write(f"grad[{s}]@mb{j}", at).value = ((data, weight), self.started)
        if op.kind is Kind.I:
            self.write(f"keep[{s}]@mb{j}", at).value = ((data, weight), self.started)
        else:
            self.add_grads(op, data, weight, at)
        self.done[op] = at

    def add_grads(self, op: Op, data: Data, weight, at: At) -> None:
        """The parameters' gradients of `op`'s stage: its micro-batch's key at its weight,
        through each layer of the stage."""
        rank, mb = data
        for layer in self.layers[op.stage]:
            self.add(Op(Kind.BWD, layer, op.mb), (rank, mb, layer), weight, at)

    def current(self, op: Op, name: str, buf, at: At) -> Any:
        """A stage buffer's value, which must be this step's."""
        value, step = buf.value
        if step != self.started:
            raise self.fail(at[2], f"{op} reads {name} of step {step}")
        return value

    def take(self, name: str, at: At):
        """Read a buffer its reader consumes (the executor pops it)."""
        if name not in self.bufs and name.startswith("RECV_"):
            raise self.fail(
                at[2], f"{self.name(at)} reads what {name} brings, which is not received here"
            )
        if name not in self.bufs and name.startswith(("act", "keep")):
            what, of = name.split("[", 1)
            made = f"the output of F[s{of}" if what == "act" else f"what I[s{of} keeps"
            raise self.fail(
                at[2],
                f"{self.name(at)} reads {made}, which this step has not made or a backward "
                "already took: each micro-batch runs each stage's backward once",
            )
        buf = self.read(name, at)
        del self.bufs[name]
        return buf

    # -- transfers -----------------------------------------------------------------------

    def send(self, ins, at: At) -> None:
        op = ins.op
        src = (
            f"act[{op.stage}]@mb{op.mb}"
            if op.kind is Kind.SEND_F
            else f"grad[{op.stage}]@mb{op.mb}"
        )
        buf = self.read(src, at) if op.kind is Kind.SEND_F else self.take(src, at)
        issue = _Issue(self.rank, at[2], ins, at, value=buf.value)
        self.p.issue(issue, f"{op.comm}:transfers")

    def received(self, issue: _Issue, value) -> None:
        assert issue.instr.op is not None
        buf = self.bufs[_recv(issue.instr.op)]
        buf.value, buf.pending = value, False

    # -- what may be pending, and the tied copies' all-reduce ----------------------------

    def _touched(self, op: Op) -> list[str]:
        if op.kind.on_stage:
            names = [f"gathered[{g.target}]" for g in self.p.gathers(op)]
            names += [_recv(op)] if op.kind in (Kind.F, Kind.B, Kind.I) else []
            if op.kind in (Kind.B, Kind.W):
                for layer in self.layers[op.stage]:
                    names += list(self.written(Op(Kind.BWD, layer, op.mb)))
            return names
        if self.tied(op):
            return [self.tied_grad(op.target)]
        return super()._touched(op)

    # -- FSDP per stage: one unsharded gradient a unit, its micro-batches added into it ---

    def grad_of(self, p: str, mb: int = 0, k: int = -1) -> str:
        return f"grad[{self.p.unit_of[p]}]" if self.fsdp else super().grad_of(p, mb, k)

    def unsharded(self, op: Op, at: At) -> str:
        return f"grad[{op.target}]"

    def freed(self, op: Op) -> str:
        return op.target

    # -- the tied copies' all-reduce: a parameter's, over the pair of ranks holding it ---

    def tied(self, op: Op) -> bool:
        """Whether `op` sums a parameter's two copies (not a bucket's, or a unit shard's
        over the replicate group)."""
        return op.kind is Kind.ALLREDUCE and op.target in self.p.numel

    def tied_grad(self, p: str) -> str:
        """The buffer the tied copy's gradient is in: its bucket, or its unit's shard."""
        return f"shard_grad[{self.p.unit_of[p]}]" if self.fsdp else self.grad_of(p)

    def reads_shards(self, op: Op) -> bool:
        return super().reads_shards(op) or (self.fsdp and self.tied(op))

    def reduce(self, ins, at: At) -> None:
        op = ins.op
        if not self.tied(op):
            return super().reduce(ins, at)
        name = self.tied_grad(op.target)
        buf = self.read_shard(name, at) if self.fsdp else self.read(name, at)
        if self.fsdp:  # the shard's pieces: the same slice on both ends
            sends = dict(buf.pieces)
        else:
            piece = (op.target, 0, self.p.numel[op.target])
            sends = {piece: buf.pieces.get(piece, EMPTY)}
        self.write(name, at).pending = True
        self.p.issue(_Issue(self.rank, at[2], ins, at, sends), at[0])

    def land(self, issue: _Issue, out) -> None:
        op = issue.instr.op
        assert op is not None
        if not self.tied(op):
            return super().land(issue, out)
        buf = self.bufs[self.tied_grad(op.target)]
        buf.pieces.update(out)
        buf.pending = False


def transfer(ranks: Mapping[int, Any], issues: list[_Issue]) -> None:  # StageRanks
    """A send and the receive FIFO order pairs it with: the receive gets what was sent, and
    must be the transfer the send is for."""
    send, recv = issues
    s_op, r_op = send.instr.op, recv.instr.op
    assert s_op is not None and r_op is not None
    if not s_op.kind.is_send or r_op.kind.is_send or s_op.tag != r_op.tag:
        raise Refuted(
            recv.rank,
            recv.index,
            f"rank {recv.rank}'s {r_op} is matched with rank {send.rank}'s {s_op} (the "
            "transport pairs a pair of ranks' transfers in issue order): it receives "
            "another tensor than it names",
        )
    ranks[recv.rank].received(recv, send.value)


def _recv(op: Op) -> str:
    """The buffer of the receive that brings a stage op's input (RECV_F for a forward,
    RECV_B for a backward): named by the receive."""
    forward = op.kind in (Kind.F, Kind.RECV_F)
    return str(stage_op(Kind.RECV_F if forward else Kind.RECV_B, op.stage, op.mb))


def _span(r: range) -> str:
    return f"{r.start} .. {r.stop - 1}"


def _data(data: Data) -> str:
    return f"micro-batch {data[1]} of rank {data[0]}"

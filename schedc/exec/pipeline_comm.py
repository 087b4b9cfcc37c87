"""Where a pipeline rank talks: its process groups and the P2P transfers it has in flight.

    comm = make_comm(rank, world, pipe, mesh)   # PipeComm: pipeline rank, replica, groups
    reads = awaited(program)              # per item, the receives it reads
    posted = Posted()                     # posted transfers, waited for lazily

Ranks are laid out pp-outermost (global rank = pipeline rank x dp + replica, ir/spec.py
PipelineSpec): each replica has its pipeline group (P2P and the norm) and the pair of its
first and last stage's ranks (the tied embedding); each pipeline rank has its dp group, the
ranks holding its stages in every replica, or under HSDP per stage (a `mesh R x S` of the dp
replicas) its shard groups and replicate groups, torchtitan's ["pp", "dp_replicate",
"dp_shard"] with pp outermost.

A transfer item is posted in the program's order and not waited for there: a receive is
waited for just before the compute that reads it (`awaited`), a send is dropped once
complete and waited for at the step's end at the latest, its tensor held until then
(`Posted`).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from schedc.ir.op import Op
from schedc.ir.pipeline import Item, Pipeline, actions, backward_kind, reader
from schedc.ir.spec import REPLICATE, SHARD, Mesh


@dataclass
class PipeComm:
    """This rank's place: its pipeline rank, its replica's pipeline group (P2P and the
    norm), the group of its replica's first and last stage's ranks (the tied embedding; None
    when one rank holds both) and, with dp > 1 replicas, the group of the ranks holding its
    stages in every replica and the group of every rank (the loss and the norm).

    HSDP per stage (`mesh R x S` of the dp replicas, ir/spec.py Mesh): `dp` is then the
    rank's shard group, the S replicas that shard its units (`shard` its index in it), and
    `replicate` the R ranks holding the same shard, over which each gradient shard is
    all-reduced; without a mesh the shard group is all dp replicas and R is 1."""

    rank: int  # pipeline rank
    group: dist.ProcessGroup | None = None  # None: the default group
    tied: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None  # None: one replica (FSDP per stage: the shard group)
    replica: int = 0
    replicas: int = 1
    world: dist.ProcessGroup | None = None  # None: the default group
    replicate: dist.ProcessGroup | None = None  # HSDP: the ranks holding this rank's shard
    mesh: Mesh | None = None  # HSDP: the dp replicas as replicate x shard; None: 1 x dp

    @property
    def me(self) -> int:
        """This rank's global rank: pipeline rank x dp + replica (pp-outermost)."""
        return self.rank * self.replicas + self.replica

    @property
    def shards(self) -> int:
        """The ranks a unit is sharded over (S; all dp replicas without a mesh)."""
        return self.mesh.shard if self.mesh else self.replicas

    @property
    def shard(self) -> int:
        """This rank's shard of each unit: its index in its shard group."""
        return self.mesh.index(self.replica, SHARD) if self.mesh else self.replica

    def global_rank(self, r: int) -> int:
        """The global rank of pipeline rank `r` of this rank's replica."""
        return r if self.group is None else dist.get_global_rank(self.group, r)


def make_comm(rank: int, world: int, pipe: Pipeline, mesh: Mesh | None = None) -> PipeComm:
    """Global `rank`'s PipeComm in a job of `world` = pp x dp ranks, pp-outermost. Every rank
    makes every group, in the same order (`dist.new_group` is collective over the default
    group): each replica's pipeline group and tied pair, then each pipeline rank's dp group
    or, under a `mesh` R x S of the dp replicas (HSDP per stage), its shard groups and then
    its replicate groups (global rank = pp_index x dp + replicate_index x S + shard_index)."""
    dp = world // pipe.pp
    assert dp * pipe.pp == world, f"world {world} is not {pipe.pp} pipeline ranks x dp"
    assert mesh is None or mesh.world == dp, f"mesh {mesh} is not the {dp} dp replicas"
    pp_rank, replica = divmod(rank, dp)
    first, last = pipe.rank_of(0), pipe.rank_of(pipe.stages - 1)
    hsdp = mesh is not None and mesh.replicate > 1
    mine = PipeComm(pp_rank, replica=replica, replicas=dp, mesh=mesh if hsdp else None)
    for d in range(dp):
        ranks = [p * dp + d for p in range(pipe.pp)]
        group = dist.new_group(ranks) if dp > 1 else None
        tied = dist.new_group([ranks[first], ranks[last]]) if first != last else None
        if d == replica:
            mine.group, mine.tied = group, tied
    # the dp replicas' groups along each dimension (one, all dp, without a mesh)
    dims = [(SHARD, "dp"), (REPLICATE, "replicate")] if hsdp else [(SHARD, "dp")]
    local = mesh if hsdp and mesh is not None else Mesh(1, dp)
    for p in range(pipe.pp if dp > 1 else 0):
        for dim, field in dims:
            for members in local.groups(dim):
                group = dist.new_group([p * dp + d for d in members])
                if p == pp_rank and replica in members:
                    setattr(mine, field, group)
    return mine


def awaited(program: list[Item]) -> list[tuple[Op, ...]]:
    """Per item, the receives of the program it reads (ir/pipeline.py `reader`): what the
    executor waits for before running it, and passes/pipeline_sim.py's lazy model too."""
    back = backward_kind(actions(program))
    by_reader = {
        reader(a, back): a for item in program for a in item if a.kind.is_p2p and not a.kind.is_send
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
        self.recvs: dict[Op, dist.Work] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def add(self, posted: list[tuple[Op, torch.Tensor]], works: list) -> None:
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        if len(works) != len(posted):  # one work for the group (a coalescing backend)
            works = works * len(posted)
        for (act, tensor), work in zip(posted, works):
            if act.kind.is_send:
                self.sends.append((work, tensor))
            else:
                self.recvs[act] = work

    def wait_recv(self, recv: Op) -> None:
        self.recvs.pop(recv).wait()

    def drain(self) -> None:
        assert not self.recvs, f"receives never read: {sorted(map(str, self.recvs))}"
        for work, _ in self.sends:
            work.wait()
        self.sends = []

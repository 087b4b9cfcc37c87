"""Where a pipeline rank talks: its process groups and the P2P transfers it has in flight.

    comm = make_comm(rank, world, pipe)   # PipeComm: pipeline rank, replica, the groups
    reads = awaited(program)              # per item, the receives it reads
    posted = Posted()                     # posted transfers, waited for lazily

Ranks are laid out pp-outermost (global rank = pipeline rank x dp + replica, ir/spec.py
PipelineSpec): each replica has its pipeline group (P2P and the norm) and the pair of its
first and last stage's ranks (the tied embedding); each pipeline rank has its dp group, the
ranks holding its stages in every replica.

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

from schedc.ir.pipeline import Action, Item, Pipeline, actions, backward_kind, reader


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

    def global_rank(self, r: int) -> int:
        """The global rank of pipeline rank `r` of this rank's replica."""
        return r if self.group is None else dist.get_global_rank(self.group, r)


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


def awaited(program: list[Item]) -> list[tuple[Action, ...]]:
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

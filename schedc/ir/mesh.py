"""The world as a mesh of replicate x shard ranks, and its process groups as interned
values (one `Group` object a group, however many instructions name it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# the two dimensions of a mesh: gradients are reduce-scattered and parameters gathered over the
# shard dimension, all-reduced over the replicate dimension
SHARD = "shard"
REPLICATE = "replicate"


class Group(tuple[int, ...]):
    """A process group's ranks in group order, interned (`Mesh.members`): one object per
    group, its hash computed once, so the proof and the executor key on it in O(1) however
    large the world (a world-length tuple hashed at every collective made check quadratic)."""

    _hash: int

    def __new__(cls, ranks) -> Group:
        g = super().__new__(cls, ranks)
        g._hash = tuple.__hash__(g)
        return g

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Group, (tuple(self),))


@lru_cache(maxsize=1 << 16)
def span(first: int, stop: int, step: int) -> Group:
    """The group range(first, stop, step), interned."""
    return Group(range(first, stop, step))


@dataclass(frozen=True)
class Mesh:
    """The world as replicate x shard, in torchrun's rank order.

    torchrun numbers ranks node by node (rank = node x nproc_per_node + local_rank), so a
    shard group is `shard` consecutive ranks (one node, when shard = nproc_per_node) and a
    replicate group is the ranks `shard` apart (the same local rank on every node):

        mesh 2 x 4:  shard groups {0 1 2 3} {4 5 6 7}, replicate groups {0 4} {1 5} {2 6} {3 7}

    Flat DDP is replicate = world (shard 1), flat FSDP shard = world (replicate 1); only
    HSDP (FSDP with both dimensions above 1) has two groups per rank.
    """

    replicate: int
    shard: int

    @property
    def world(self) -> int:
        return self.replicate * self.shard

    def __str__(self) -> str:
        return f"{self.replicate} x {self.shard}"

    def size(self, dim: str) -> int:
        return self.shard if dim == SHARD else self.replicate

    def members(self, rank: int, dim: str, base: int = 0) -> Group:
        """The ranks of `rank`'s group along `dim`, in rank order (one interned object a
        group), each plus `base` (a pipeline rank's first global rank)."""
        if dim == SHARD:
            first = base + rank - rank % self.shard
            return span(first, first + self.shard, 1)
        return span(base + rank % self.shard, base + self.world, self.shard)

    def index(self, rank: int, dim: str) -> int:
        """`rank`'s position in its group along `dim` (its shard, along SHARD)."""
        return rank % self.shard if dim == SHARD else rank // self.shard

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group along `dim`, in the order of their lowest rank."""
        firsts = range(0, self.world, self.shard) if dim == SHARD else range(self.shard)
        return [self.members(r, dim) for r in firsts]

"""The abstract values of the proof (passes/prove.py): what a gradient buffer holds, exactly.

A gradient element holds a weighted sum of micro-batch gradients. Its abstract value is a
map from (rank, micro-step, layer) to a Fraction: the weight of that micro-step's mean-loss
gradient, on that rank, through that layer's backward (a tied parameter has two writers:
the embedding's and the head's). Backward adds its key at the loss scale; a reduction sums
its group's maps, each divided by its divisor; no_sync only accumulates.

The theorem, for a parameter read by the optimizer: for each of its writers, every position
n of the step's global batch gets weight exactly 1/S (per token 1/(S T): the single-process
mean over the global batch), where a key's weight x spreads as x/c over the c positions its
(rank, micro-step) read (ir/bound.py's batch slices). That is agree.py's sequence weights,
per parameter element and after every collective.

By classes of ranks (passes/symmetry.py) a key's rank may be a set of ranks, a negative
integer: the ranks agreeing with one on all but some dimensions, each at the key's weight
(a reduction over a class's group spreads a key over it: `Maps.spread`).

Maps are interned: buffers hold small integers, and sums and checks are computed once per
distinct argument, so a plan of thousands of parameter pieces costs a few hundred sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

Key = tuple[int, int, str]  # (rank or set of ranks, micro-step, layer)
EMPTY = 0  # the id of the empty map (a buffer nothing has written)

Sub = tuple[tuple[tuple[int, str], Fraction], ...]  # one micro-step's: ((rank, layer), weight)
Outer = tuple[tuple[int, int], ...]  # (micro-step, sub-map id), by micro-step


class Maps:
    """Interned maps Key -> Fraction, and the arithmetic of the proof on their ids.

    A map is stored per micro-step: (micro-step -> sub-map id), each sub-map (rank, layer)
    -> weight, both interned. A sum touches the sub-maps of the micro-steps its terms share
    and reuses the rest, so adding one micro-step's gradient into a buffer that holds k of
    them costs O(k) ids, not O(k x ranks x layers) weights: the proof stays linear in the
    micro-steps."""

    def __init__(self) -> None:
        self.subs: list[Sub] = [()]
        self._sub_ids: dict[Sub, int] = {(): 0}
        self.outers: list[Outer] = [()]
        self._ids: dict[Outer, int] = {(): EMPTY}
        self._memo: dict[tuple, int] = {}

    def _sub(self, d: dict[tuple[int, str], Fraction]) -> int:
        items = tuple(sorted((k, w) for k, w in d.items() if w))
        found = self._sub_ids.get(items)
        if found is None:
            found = self._sub_ids[items] = len(self.subs)
            self.subs.append(items)
        return found

    def _of(self, d: dict[int, int]) -> int:
        items = tuple(sorted((mb, sid) for mb, sid in d.items() if sid))
        found = self._ids.get(items)
        if found is None:
            found = self._ids[items] = len(self.outers)
            self.outers.append(items)
        return found

    def items(self, m: int) -> list[tuple[Key, Fraction]]:
        """The map's weights, by (rank, micro-step, layer)."""
        return [
            ((r, mb, layer), w) for mb, sid in self.outers[m] for (r, layer), w in self.subs[sid]
        ]

    def get(self, m: int) -> dict[Key, Fraction]:
        return dict(self.items(m))

    def add(self, m: int, key: Key, w: Fraction) -> int:
        """`m` with `w` more of `key`."""
        memo = ("add", m, key, w.numerator, w.denominator)  # a Fraction's hash is a pow()
        if memo not in self._memo:
            rank, mb, layer = key
            outer = dict(self.outers[m])
            sub = dict(self.subs[outer.get(mb, 0)])
            sub[(rank, layer)] = sub.get((rank, layer), Fraction(0)) + w
            outer[mb] = self._sub(sub)
            self._memo[memo] = self._of(outer)
        return self._memo[memo]

    def combine(self, parts: Sequence[tuple[int, int]]) -> int:
        """The sum of each map divided by its divisor: ((map, divisor), ...)."""
        memo = ("sum", tuple(parts))
        if memo not in self._memo:
            per: dict[int, list[tuple[int, int]]] = {}
            for m, div in parts:
                for mb, sid in self.outers[m]:
                    per.setdefault(mb, []).append((sid, div))
            self._memo[memo] = self._of({mb: self._combine_sub(ps) for mb, ps in per.items()})
        return self._memo[memo]

    def spread(self, m: int, over: Callable[[int], tuple[int, int]], tag: object, div: int) -> int:
        """The sum of a group's translated copies of `m` (passes/symmetry.py), each divided by
        `div`: `over(rank)` is what a key's rank becomes summed over the group and how many
        times each of its ranks is counted; `tag` names `over` for the memo."""
        memo = ("spread", m, tag, div)
        if memo not in self._memo:
            outer: dict[int, int] = {}
            for mb, sid in self.outers[m]:
                d: dict[tuple[int, str], Fraction] = {}
                for (r, layer), w in self.subs[sid]:
                    into, times = over(r)
                    d[(into, layer)] = d.get((into, layer), Fraction(0)) + w * times / div
                outer[mb] = self._sub(d)
            self._memo[memo] = self._of(outer)
        return self._memo[memo]

    def _combine_sub(self, parts: list[tuple[int, int]]) -> int:
        if len(parts) == 1 and parts[0][1] == 1:
            return parts[0][0]
        memo = ("sub", tuple(parts))
        if memo not in self._memo:
            d: dict[tuple[int, str], Fraction] = {}
            for sid, div in parts:
                for k, w in self.subs[sid]:
                    d[k] = d.get(k, Fraction(0)) + (w / div if div != 1 else w)
            self._memo[memo] = self._sub(d)
        return self._memo[memo]


@dataclass(frozen=True)
class Wrong:
    """How a parameter's gradient differs from the single-process one: for some writer, the
    positions of the global batch it misses, counts twice or more, or weighs otherwise."""

    layer: str
    missing: tuple[int, ...]
    twice: tuple[int, ...]
    weighed: tuple[tuple[int, Fraction], ...]  # (position, per-sequence weight), neither 0 nor 2/S


class Theorem:
    """Whether a map is the single-process gradient of a parameter written by `writers`;
    `slices[(rank, mb)]` is the slice of the step's batch that (rank, mb) read, `readers`
    the ranks whose forward reads it (a pipeline's: its first stage's), `members(x)` the
    ranks of a key's rank (passes/symmetry.py: a set of ranks, or one)."""

    def __init__(
        self,
        maps: Maps,
        seqs: int,
        slices: dict[tuple[int, int], range],
        readers: Sequence[int],
        members: Callable[[int], tuple[int, ...]] = lambda r: (r,),
    ):
        self.maps, self.S, self.slices, self.members = maps, seqs, slices, members
        self._memo: dict[tuple[int, tuple[str, ...]], Wrong | None] = {}
        # when the readers' slices partition the step's batch, a map is right iff it holds
        # every (reader, micro-step) of every writer at count/S: no position by position sum
        self.readers = frozenset(readers)
        mine = [ids for (r, _), ids in slices.items() if r in self.readers]
        seen = sorted(n for ids in mine for n in ids)
        self.partition = seen == list(range(seqs)) and all(len(i) for i in mine)
        self.pairs = len(mine)
        self._count: dict[tuple[int, int], int | None] = {}

    def check(self, m: int, writers: tuple[str, ...]) -> Wrong | None:
        memo = (m, writers)
        if memo not in self._memo:
            self._memo[memo] = None if self._fast(m, writers) else self._check(m, writers)
        return self._memo[memo]

    def _fast(self, m: int, writers: tuple[str, ...]) -> bool:
        if not self.partition:
            return False
        seen, keys = 0, set()
        for (x, mb, layer), w in self.maps.items(m):
            n = self._length(x, mb)
            if n is None or layer not in writers or w * self.S != n:
                return False
            seen += len(self.members(x))
            keys.add((x, mb, layer))
        return seen == len(writers) * self.pairs and self._disjoint(keys)

    def _length(self, x: int, mb: int) -> int | None:
        """The one length of the slices of `x`'s ranks at `mb`, all readers; else None."""
        if (x, mb) not in self._count:
            ranks = self.members(x)
            lengths = {len(self.slices.get((r, mb), ())) for r in ranks}
            ok = len(lengths) == 1 and self.readers.issuperset(ranks)
            self._count[(x, mb)] = lengths.pop() if ok else None
        return self._count[(x, mb)]

    def _disjoint(self, keys: set[tuple[int, int, str]]) -> bool:
        """No (rank, micro-step, layer) twice among keys whose ranks are sets."""
        if all(x >= 0 for x, _, _ in keys):
            return True  # distinct keys of one rank each
        seen: set[tuple[int, int, str]] = set()
        for x, mb, layer in keys:
            for r in self.members(x):
                if (r, mb, layer) in seen:
                    return False
                seen.add((r, mb, layer))
        return True

    def _check(self, m: int, writers: tuple[str, ...]) -> Wrong | None:
        per: dict[str, list[Fraction]] = {w: [Fraction(0)] * self.S for w in writers}
        for (x, mb, layer), w in self.maps.items(m):
            if layer not in per:  # a layer that does not write this parameter: no such key
                per[layer] = [Fraction(0)] * self.S
            for rank in self.members(x):
                ids = self.slices.get((rank, mb), range(0))
                for n in ids:
                    if 0 <= n < self.S:
                        per[layer][n] += w / len(ids)
        want = Fraction(1, self.S)
        for layer, ws in per.items():
            if layer in writers and all(x == want for x in ws):
                continue
            target = want if layer in writers else Fraction(0)
            return Wrong(
                layer,
                tuple(n for n, x in enumerate(ws) if x == 0 and target),
                tuple(n for n, x in enumerate(ws) if target and x >= 2 * target),
                tuple(
                    (n, x)
                    for n, x in enumerate(ws)
                    if x != target and x != 0 and not (target and x >= 2 * target)
                ),
            )
        return None

"""The proof by classes of ranks (passes/symmetry.py): it proves what the proof rank by rank
proves, and refutes what it refutes, on every bundled schedule and on every plan mutation
applied alike to every rank of a class (a mutation of one rank leaves the world without
classes: it is proved rank by rank, tests/passes/test_proof.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from schedc.compiler import compile_file, compile_text
from schedc.passes.prove import _Prover, prove
from schedc.passes.prove_rank import Refuted
from schedc.passes.symmetry import ALL, RankSets, classes_of
from tests.passes.test_proof import PIPELINES, SCHEDULES, SOURCES, bounds_of
from tests.plan_mutations import CLASSES, on_rank


def _outcome(spec, bounds, classes: bool) -> str | None:
    try:
        prove(spec, bounds, classes)
    except Refuted as e:
        return e.message
    return None


def _by_classes(spec, bounds) -> bool:
    return classes_of(spec, bounds) is not None


@pytest.mark.parametrize("name", [p.stem for p in SCHEDULES] + [f"pipeline/{n}" for n in PIPELINES])
def test_every_bundled_schedule_proves_alike_by_classes(name):
    c = compile_file(SCHEDULES[0].parent / f"{name}.sched")
    bounds = bounds_of(c)
    dp = c.spec.dp
    assert _by_classes(c.spec, bounds) == (dp > 1), name  # a replicated world has classes
    a, b = prove(c.spec, bounds, True), prove(c.spec, bounds, False)
    assert dataclasses.replace(a, ms=0) == dataclasses.replace(b, ms=0)


def _alike(mutate, spec, bounds) -> list[tuple[str, list]]:
    """Each variant of a mutation class made on every rank at once: rank r's plan is the
    one the variant made with r the mutated rank (`on_rank`), so ranks of one class carry
    the same bug at their own coordinates."""
    per_rank = []
    for r in range(len(bounds)):
        with on_rank(r):
            per_rank.append(list(mutate(spec, bounds)))
    n = min(len(v) for v in per_rank)
    return [
        (per_rank[-1][i][0], [per_rank[r][i][1][r] for r in range(len(bounds))]) for i in range(n)
    ]


def test_a_mutation_on_every_rank_is_judged_alike_by_classes():
    """The two proofs agree on each variant (refuted or not), and the proof by classes
    refutes many: every class of mutation that keeps the world's classes."""
    refuted: Counter = Counter()
    for name, text in {**SOURCES, **PIPELINES}.items():
        c = compile_text(text, f"{name}.sched")
        if c.spec.dp < 2:
            continue
        bounds = bounds_of(c)
        for cls, mutate in CLASSES.items():
            for label, variant in _alike(mutate, c.spec, bounds):
                by_classes = _outcome(c.spec, variant, True)
                by_ranks = _outcome(c.spec, variant, False)
                assert (by_classes is None) == (by_ranks is None), (
                    name, label, by_classes, by_ranks
                )  # fmt: skip
                if by_classes is not None and _by_classes(c.spec, variant):
                    refuted[cls] += 1
    assert sum(refuted.values()) >= 300, refuted
    assert len(refuted) >= 15, refuted


def test_rank_sets_widen_over_a_group_and_count_what_it_already_covers():
    sets = RankSets((2, 2, 4))  # pp 2 x replicate 2 x shard 4: rank = p*8 + i*4 + j
    row, times = sets.widen(9, (2,))  # rank (1, 0, 1) over its shard group
    assert times == 1 and sets.coords(row) == (1, 0, ALL)
    assert sets.members(row) == (8, 9, 10, 11)
    plane, times = sets.widen(row, (1, 2))  # then its whole stage: the shard dim again
    assert times == 4 and sets.members(plane) == tuple(range(8, 16))
    assert sets.widen(5, ()) == (5, 1)


def test_a_world_of_4096_is_proved_by_classes():
    """The bundled DDP schedule at world 4,096: one representative executed, the other
    ranks checked to be it translated."""
    text = (SCHEDULES[0].parent / "tiny_4gpu.sched").read_text()
    text = text.replace("world 4", "world 4096").replace("batch 16 x", "batch 16384 x")
    c = compile_text(text, "big.sched", prove=False)
    bounds = bounds_of(c)
    prover = _Prover(c.spec, bounds)
    assert prover.sym is not None and list(prover.ranks) == [0]
    prover.run()

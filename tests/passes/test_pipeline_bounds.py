"""A pipeline's check is linear in its actions and capped (#42).

`backward_kind` once rescanned every action for every action (pipeline_gen.compute_times),
and nx.find_cycle walked again from every root what earlier roots had explored: a 142-byte
file of `microbatches 5300` took 92 s of CPU, 1,000 stages 204 s. Each pass now walks each
action a bounded number of times, and a step of more than MAX_OPS actions (the DP graph's
bound) is refused before any is built, at `microbatches`. No timings are asserted here
(docs/benchmarks.md keeps those): the files just under the cap and of 1,000 stages are
checked in a process of their own under a generous timeout, which the quadratic passes ran
past.
"""

from __future__ import annotations

import random
import re

import networkx as nx
import pytest

from schedc.compiler import compile_text
from schedc.ir.pipeline import Pipeline, Placement, actions, step_actions
from schedc.lang.diagnostics import CompileError
from schedc.lang.resolve import MAX_OPS
from schedc.passes.pipeline_check import first_cycle
from schedc.passes.pipeline_gen import Request, Schedule, generate, request_errors
from tests.ranks import python


def two_stages(m: int, schedule: str = "1f1b", n_layer: int = 1) -> str:
    """`m` micro-batches of one sequence on 2 stages (n_layer = 1: 2 m x 3 layers is under
    the batch arithmetic's own bound, so the pipeline's is the one that counts)."""
    return (
        f"model tiny {{ n_layer = {n_layer} }}\nworld 2\nbatch {m} x 64\npipeline {{\n"
        f"  stage s0 = embed, h.0\n  stage s1 = head\n  microbatches {m}\n"
        f"  schedule {schedule}\n}}\n"
    )


def stages(n: int, m: int = 1, schedule: str = "gpipe") -> str:
    """`n` stages of one layer each, one a rank."""
    body = "".join(f"  stage s{i} = h.{i - 1}\n" for i in range(1, n - 1))
    return (
        f"model tiny {{ n_layer = {n - 2} }}\nworld {n}\nbatch {m} x 64\npipeline {{\n"
        f"  stage s0 = embed\n{body}  stage s{n - 1} = head\n  microbatches {m}\n"
        f"  schedule {schedule}\n}}\n"
    )


def check(tmp_path, text: str):
    path = tmp_path / "p.sched"
    path.write_text(text)
    return python("-m", "schedc", "check", str(path), timeout=60)


@pytest.mark.parametrize(
    "text, actions",
    [
        (two_stages(5300), "2 stages x 5,300 micro-batches make 42,400 actions a step"),
        (two_stages(3201, "zb-h1"), "make 32,010 actions a step (19,206 computes"),
        (stages(100, 100, "1f1b"), "100 stages x 100 micro-batches make 59,600 actions"),
    ],
    ids=["1f1b-m5300", "zb-h1-m3201", "1f1b-100-stages"],
)
def test_a_step_past_the_cap_is_refused_at_microbatches(text, actions, tmp_path):
    r = check(tmp_path, text)
    assert r.returncode == 1, r.stderr[-3000:]
    first, line = r.stderr.splitlines()[:2]
    assert re.match(rf"{re.escape(str(tmp_path))}/p\.sched:\d+:3: error: ", first), first
    assert first.endswith("[value-range]") and actions in first
    assert f"schedc proves at most {MAX_OPS:,}" in first
    assert line.split("|")[1].strip().startswith("microbatches ")


def test_the_cap_is_located_in_process():
    with pytest.raises(CompileError) as info:
        compile_text(two_stages(5300), "p.sched")
    [d] = info.value.diagnostics
    assert d.code == "value-range" and info.value.source.snippet(d.span) == "microbatches 5300"
    assert d.hint == "fewer micro-batches (a larger `micro`), or fewer stages"


def test_the_batch_arithmetic_bound_is_located_at_microbatches():
    """2 m x layers over MAX_OPS (the DP bound, also read for a pipeline) is located too: it
    was said at no line for a pipeline, whose micro-batch count is `microbatches`."""
    text = two_stages(3000).replace("n_layer = 1", "n_layer = 4").replace("h.0\n", "h.0 .. h.3\n")
    with pytest.raises(CompileError) as info:
        compile_text(text, "p.sched")
    [d] = info.value.diagnostics
    assert d.code == "value-range" and "3,000 micro-steps make 36,000" in d.message
    assert info.value.source.snippet(d.span) == "microbatches 3000"


@pytest.mark.parametrize(
    "text",
    [two_stages(4000), two_stages(3200, "zb-h1"), stages(1000)],
    ids=["1f1b-m4000-at-the-cap", "zb-h1-m3200-at-the-cap", "gpipe-1000-stages"],
)
def test_a_step_at_the_cap_checks(text, tmp_path):
    r = check(tmp_path, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every rank's program proven" in r.stdout


def test_written_programs_are_capped_too():
    """Programs written for 5,000 micro-batches (of which they hold 1): refused by the cap
    before they are found short of computes."""
    programs = (
        "  program on rank 0 { F[s0]@mb0  SEND_F[s0]@mb0  RECV_B[s0]@mb0  B[s0]@mb0 }\n"
        "  program on rank 1 { RECV_F[s1]@mb0  F[s1]@mb0  B[s1]@mb0  SEND_B[s1]@mb0 }\n}"
    )
    text = two_stages(5000).replace("  schedule 1f1b\n}", programs)
    with pytest.raises(CompileError) as info:
        compile_text(text, "p.sched")
    [d] = info.value.diagnostics
    assert d.code == "value-range" and "make 40,000 actions a step" in d.message
    assert info.value.source.snippet(d.span) == "microbatches 5000"


CASES = [
    Request(s, pp, m, v)
    for s in Schedule
    for pp in range(1, 5)
    for m in range(1, 2 * pp + 2)
    for v in ((2, 3) if s is Schedule.INTERLEAVED else (2,) if s is Schedule.ZB_V else (1,))
    if not request_errors(Request(s, pp, m, v))
]


@pytest.mark.parametrize("req", CASES, ids=str)
def test_the_cap_counts_what_the_generator_makes(req):
    gen = generate(req)
    acts = [a for p in gen.programs.values() for a in actions(p)]
    computes = sum(not a.kind.is_p2p for a in acts)
    assert step_actions(gen.pipeline, req.schedule.splits_backward) == (
        computes,
        len(acts) - computes,
    )


@pytest.mark.parametrize("placement", list(Placement))
def test_stages_of_inverts_rank_of(placement):
    for pp in range(1, 6):
        for v in range(1, 5):
            pipe = Pipeline(pp, pp * v, 1, placement)
            for r in range(-1, pp + 1):
                want = [s for s in range(pipe.stages) if pipe.rank_of(s) == r]
                assert pipe.stages_of(r) == want


def test_first_cycle_is_the_one_find_cycle_finds():
    """The linear search meets the cycle networkx's does (its order: roots, then successors,
    as inserted), so the deadlock said is the same; and None where networkx finds none."""
    rng = random.Random(42)
    for _ in range(400):
        n = rng.randint(1, 12)
        g = nx.DiGraph()
        g.add_nodes_from(rng.sample(range(n), n))
        for _ in range(rng.randint(0, 2 * n)):
            a, b = rng.randrange(n), rng.randrange(n)
            if a != b:
                g.add_edge(a, b)
        try:
            want = [u for u, _ in nx.find_cycle(g)]
        except nx.NetworkXNoCycle:
            want = None
        assert first_cycle(g) == want, list(g.edges)

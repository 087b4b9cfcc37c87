"""Pipeline programs written in .sched (`program on rank N { ... }` in the pipeline block):
they read back as the programs the named schedules generate, prove with the same bubble and
reach the executor as written; the three hang classes of #31, written as programs
(schedules/pipeline/hangs/), are refused at the item, with the ranks' programs side by side.
"""

from __future__ import annotations

import pytest

from schedc.cli.main import main
from schedc.compiler import compile_file, compile_text
from schedc.ir.pipeline import Placement, Schedule, Written, format_item
from schedc.lang.diagnostics import CompileError
from schedc.passes.pipeline_gen import Request, generate
from tests.goldens import REPO

PIPELINE = REPO / "schedules" / "pipeline"
HANGS = PIPELINE / "hangs"


def written_text(schedule: Schedule, pp: int, m: int, v: int = 1) -> str:
    """A schedule with the named schedule's generated programs written out, one a rank."""
    gen = generate(Request(schedule, pp, m, v))
    stages = [f"  stage s{k} = h.{k}\n" for k in range(pp * v)]
    stages[0] = "  stage s0 = embed, h.0\n"
    stages[-1] = f"  stage s{pp * v - 1} = h.{pp * v - 1}, head\n"
    if gen.pipeline.placement is Placement.V:  # written programs run in either placement
        stages.append("  placement v\n")
    programs = "".join(
        f"  program on rank {r} {{ {' '.join(format_item(i) for i in p)} }}\n"
        for r, p in sorted(gen.programs.items())
    )
    return (
        f"model nano {{ n_layer = {pp * v} }} world {pp} batch {2 * m} x 32 micro 2\n"
        f"pipeline {{\n{''.join(stages)}{programs}}}\n"
    )


@pytest.mark.parametrize(
    "schedule, pp, m, v",
    [
        (Schedule.ONE_F_ONE_B, 2, 4, 1),
        (Schedule.GPIPE, 3, 2, 1),
        (Schedule.ZB_H1, 4, 4, 1),
        (Schedule.INTERLEAVED, 2, 4, 2),
        (Schedule.ZB_V, 3, 5, 2),  # in a V: rank 0 holds s0 and s5
    ],
)
def test_written_generated_programs_prove_as_generated(schedule, pp, m, v):
    """The text round-trips to the generated programs, with the same proof and bubble."""
    text = written_text(schedule, pp, m, v)
    named = text.split("  program on rank 0")[0] + f"  schedule {schedule.value}\n}}\n"
    written, generated = compile_text(text, "w.sched"), compile_text(named, "g.sched")
    w, g = written.pipeline, generated.pipeline
    assert w is not None and g is not None and written.spec.pipeline is not None
    assert written.spec.pipeline.schedule is Written.PROGRAMS
    assert w.programs == g.programs == generate(Request(schedule, pp, m, v)).programs
    assert (w.pipeline, w.step, w.bubble) == (g.pipeline, g.step, g.bubble)
    assert written.dump("pipeline") == generated.dump("pipeline")


def test_the_bundled_written_1f1b_is_the_generated_one():
    """What `schedc run` runs: exec/pipeline_train.py runs the rank's plan bound from the
    plan's programs (passes/pipeline_bind.py), so the written ones run as written."""
    c = compile_file(PIPELINE / "tiny_pp2_written.sched")
    named = compile_text(
        (PIPELINE / "tiny_pp2_written.sched").read_text().split("  program on rank 0")[0]
        + "  schedule 1f1b\n}\n",
        "named.sched",
    )
    assert c.pipeline is not None and named.pipeline is not None
    assert c.pipeline.programs == named.pipeline.programs
    assert c.pipeline.bubble == named.pipeline.bubble == {0: 0.2, 1: 0.2}
    assert c.spec.accum == 4 and c.spec.micro == 2 and c.warnings == ()


def test_check_prints_the_written_pipeline_and_dumps_it(capsys):
    path = str(PIPELINE / "tiny_pp2_written.sched")
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  pipeline "))
    assert "2 stages, written, placement loop, 4 micro-batches" in line
    assert "bubble per rank 20.0% 20.0%" in line
    assert main(["check", "--dump", "pipeline", path]) == 0
    dump = capsys.readouterr().out
    assert dump.splitlines()[0].split() == ["rank", "0", "rank", "1"]
    assert "  3 SEND_F[s0]@mb1+RECV_B[s0]@mb0" in dump


# -- the three hang classes of #31, as written programs ------------------------------------------

# (file, code, line:col, underlined, message, lines the side-by-side note holds)
HANG_CASES = [
    pytest.param(
        "deferred_recv.sched",
        "pp-deadlock",
        (23, 43),
        "SEND_B[s1]@mb0",
        "deadlock: rank 1 blocks in SEND_B[s1]@mb0 until rank 0 posts RECV_B[s0]@mb0 (its item "
        "4); rank 0 blocks in SEND_F[s0]@mb1 until rank 1 posts RECV_F[s1]@mb1 (its item 4)",
        [
            "3 SEND_F[s0]@mb1 <-- blocks: waits for rank 1's RECV_F[s1]@mb1    "
            "3 SEND_B[s1]@mb0 <-- blocks: waits for rank 0's RECV_B[s0]@mb0",
            "4 RECV_B[s0]@mb0 <-- not yet posted                               "
            "4 RECV_F[s1]@mb1 <-- not yet posted",
        ],
        id="deferred-recv",
    ),
    pytest.param(
        "fifo_two_communicators.sched",
        "pp-deadlock",
        (25, 5),
        "RECV_F[s1]@mb1:c1",
        "deadlock: rank 1 blocks in RECV_F[s1]@mb1:c1 until rank 0 posts SEND_F[s0]@mb1:c1 (its "
        "item 3); rank 0 blocks in SEND_F[s0]@mb0 until rank 1 posts RECV_F[s1]@mb0 (its item 1)",
        [
            "1 SEND_F[s0]@mb0 <-- blocks: waits for rank 1's RECV_F[s1]@mb0    "
            "1 RECV_F[s1]@mb0 <-- not yet posted",
            "3 SEND_F[s0]@mb1:c1 <-- not yet posted",
        ],
        id="fifo-two-communicators",
    ),
    pytest.param(
        "few_microbatches_1f1b.sched",
        "pp-placement",
        (24, 59),
        "F[s0]@mb2",
        "rank 0 runs F[s0]@mb2: micro-batch 2 does not exist (2 micro-batches)",
        ["4 F[s0]@mb2 <--"],
        id="few-microbatches-1f1b",
    ),
]


@pytest.mark.parametrize("name, code, at, underlined, message, rows", HANG_CASES)
def test_a_hang_class_is_refused_at_the_item(name, code, at, underlined, message, rows):
    with pytest.raises(CompileError) as info:
        compile_file(HANGS / name)
    e = info.value
    assert set(e.codes) == {code}, e.render()
    d = e.diagnostics[0]
    assert (d.span.line, d.span.col) == at and e.source.snippet(d.span) == underlined
    assert message in d.message
    side = d.notes[-1]
    assert side.span is None and side.message.startswith("the ranks' programs, side by side:")
    for row in rows:
        assert row in side.message
    rendered = e.render()
    assert rendered.startswith(f"schedules/pipeline/hangs/{name}:{at[0]}:{at[1]}: error: ") or (
        f"{name}:{at[0]}:{at[1]}: error: " in rendered.splitlines()[0]
    )
    assert "    rank 0" in rendered and "Traceback" not in rendered


def test_the_deadlocks_name_both_ranks_at_their_items():
    """Each deadlock's notes point at the other three items of the cycle, in both ranks."""
    with pytest.raises(CompileError) as info:
        compile_file(HANGS / "deferred_recv.sched")
    d = info.value.diagnostics[0]
    at = [(n.span.line, n.span.col) for n in d.notes if n.span is not None]
    assert at == [(20, 5), (19, 43), (24, 5)]
    assert [n.message.split(":")[0] for n in d.notes[:3]] == [
        "rank 0, item 4",
        "rank 0, item 3",
        "rank 1, item 4",
    ]


def test_the_1f1b_for_too_few_microbatches_proves_with_its_warm_up_clamped():
    """torchtitan#775: m < pp is no hang once the warm-up is min(pp - 1 - rank, m)."""
    text = (HANGS / "few_microbatches_1f1b.sched").read_text()
    fixed = text.replace("  F[s0]@mb2  SEND_F[s0]@mb2", "").replace(
        "  RECV_B[s0]@mb2  B[s0]@mb2", ""
    )
    c = compile_text(fixed, "clamped.sched")
    assert c.pipeline is not None and c.spec.accum == 2 < c.pipeline.pipeline.pp
    apart = fixed.replace("SEND_F[s2]@mb1+RECV_B[s2]@mb0", "SEND_F[s2]@mb1  RECV_B[s2]@mb0")
    with pytest.raises(CompileError) as info:  # the steady state's group written apart
        compile_text(apart.replace("SEND_B[s3]@mb0+RECV_F", "SEND_B[s3]@mb0  RECV_F"), "a.sched")
    assert info.value.codes == ["pp-deadlock"]


def test_the_fifo_inversion_on_one_communicator_is_a_misdelivery():
    text = (HANGS / "fifo_two_communicators.sched").read_text().replace(":c1", "")
    with pytest.raises(CompileError) as info:
        compile_text(text, "one.sched")
    assert info.value.codes == ["pp-fifo"]


def test_two_communicators_are_proven_again_as_the_executor_runs_them():
    """Programs that prove on two communicators are proven again on the one group schedc's
    executor issues every transfer on: there the inversion is a misdelivery."""
    text = (HANGS / "fifo_two_communicators.sched").read_text()
    grouped = text.replace("RECV_F[s1]@mb1:c1  RECV_F[s1]@mb0", "RECV_F[s1]@mb1:c1+RECV_F[s1]@mb0")
    with pytest.raises(CompileError) as info:
        compile_text(grouped, "grouped.sched")
    assert info.value.codes == ["pp-fifo"]
    d = info.value.diagnostics[0]
    assert "as run: schedc's executor issues every transfer" in d.notes[-1].message
    assert (d.span.line, d.span.col) == (21, 16)  # rank 0's SEND_F[s0]@mb0, its 1st send


def test_thousands_of_items_and_huge_numbers_do_not_crash():
    base = (PIPELINE / "tiny_pp2_written.sched").read_text()
    many = base.replace(
        "B[s0]@mb3                           # drain", "B[s0]@mb3 " + "F[s0]@mb0 " * 5000
    )
    with pytest.raises(CompileError) as info:
        compile_text(many, "many.sched")
    assert set(info.value.codes) == {"pp-once"}
    assert "... and" in info.value.render() or len(info.value.diagnostics) <= 50
    huge = base.replace("program on rank 1", "program on rank " + "9" * 5000)
    with pytest.raises(CompileError) as info:
        compile_text(huge, "huge.sched")
    assert "value-range" in info.value.codes
    big = base.replace("microbatches 4 ", "microbatches 1000 ").replace("batch 8 x", "batch 2000 x")
    with pytest.raises(CompileError) as info:  # one diagnostic, not 4,000 findings
        compile_text(big, "big.sched")
    [d] = info.value.diagnostics
    assert d.code == "pp-once" and "2 stages x 1,000 micro-batches need at least 4,000" in d.message
    assert info.value.source.snippet(d.span) == "microbatches 1000"

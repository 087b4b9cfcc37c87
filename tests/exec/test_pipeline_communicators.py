"""Written transfers on a second communicator (`SEND_F[s0]@mb1:c1`) run as `check` proved them
(#42): schedc's executor issues every transfer on the pipeline's one group, so the programs
are proven again as run, with every transfer on `pp`, and the plan holds those, the programs
that run. A plan that kept `:c1` was proven by `check` and then failed at run time with
`KeyError: Action(kind=<Kind.RECV_F>, stage=1, mb=1, comm='pp')` (the executor received
under the written action and looked for the received tensor under the plain one).

Two steps on the pool's ranks equal the single-process reference of the same text.
"""

from __future__ import annotations

import re

import pytest

from schedc.compiler import compile_text
from schedc.ir.op import DEFAULT_COMM
from schedc.ir.pipeline import actions
from tests.goldens import REPO
from tests.oracle import assert_matches, reference_steps
from tests.pipeline_ranks import merged

RUN_FILE = "tests.pipeline_ranks:run_file"
WRITTEN = (REPO / "schedules" / "pipeline" / "tiny_pp2_written.sched").read_text()
# micro-batch 1's activation on c1, the rest on pp: the issue's program
ONE_ON_C1 = WRITTEN.replace("SEND_F[s0]@mb1+", "SEND_F[s0]@mb1:c1+").replace(
    "RECV_F[s1]@mb1 ", "RECV_F[s1]@mb1:c1 "
)
# every transfer on c1: one communicator, named
HEAD, BLOCK = WRITTEN.split("pipeline {")
ALL_ON_C1 = HEAD + "pipeline {" + re.sub(r"((?:SEND|RECV)_[FB]\[s\d\]@mb\d)", r"\1:c1", BLOCK)
CASES = {"one-transfer-on-c1": (ONE_ON_C1, 2), "every-transfer-on-c1": (ALL_ON_C1, 16)}


@pytest.mark.parametrize("name", CASES)
def test_the_plan_holds_the_programs_as_run(name):
    """`check` proves the programs and the plan holds them on the one group: the written
    programs with each communicator dropped, item for item."""
    text, written = CASES[name]
    assert text.count(":c1") == written
    c = compile_text(text, f"{name}.sched")
    plan = c.pipeline
    assert plan is not None and c.spec.pipeline is not None and c.spec.pipeline.written
    as_written = c.spec.pipeline.written.programs
    assert sum(a.comm == "c1" for p in as_written.values() for a in actions(p)) == written
    assert plan.programs == {
        r: [tuple(a._replace(comm=DEFAULT_COMM) for a in item) for item in p]
        for r, p in as_written.items()
    }
    assert plan.programs == compile_text(WRITTEN, "w.sched").pipeline.programs


@pytest.mark.parametrize("name", CASES)
def test_a_program_on_a_second_communicator_runs_what_check_proved(pool, tmp_path, name):
    text, _ = CASES[name]
    path = tmp_path / f"{name}.sched"
    path.write_text(text)
    per_rank = pool.call(RUN_FILE, 2, str(path), None, 2, timeout=60)
    assert_matches(merged(per_rank), reference_steps(text, 2))

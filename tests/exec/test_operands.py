"""Every operand of a bound plan, perturbed one at a time (tests/operand_perturbations.py),
is either refuted by the proof or, run on CPU ranks with the proof bypassed, still makes
the single-process update: the executor uses no operand the proof did not read, and the
proof reads none the executor ignores.

On the bundled tiny DDP, FSDP and HSDP schedules and on 1F1B pipelines (DDP and FSDP per
stage, nano's width); the perturbations the proof accepts are run, two steps, against the
reference (tests/oracle.py's tolerances).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m pytest -q tests/exec/test_operands.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedc.compiler import compile_text
from schedc.passes.pipeline_gen import Schedule
from schedc.passes.prove import prove
from schedc.passes.prove_rank import Refuted
from tests.goldens import REPO
from tests.operand_perturbations import perturbations
from tests.oracle import assert_matches
from tests.pipeline_ranks import Case, merged, reference, replicas
from tests.strategies import tally

STEPS = 2
FILES = ["tiny_ddp_overlap", "tiny_fsdp_prefetch", "tiny_hsdp"]
CASES = {
    "pp-ddp": Case(Schedule.ONE_F_ONE_B, 2, 2, dp=2, buckets=2),
    "pp-fsdp": Case(Schedule.ONE_F_ONE_B, 2, 2, dp=2, fsdp=True),
}


def _sorted(spec, bounds) -> tuple[list[str], list[str], set[str]]:
    """(refuted, accepted) labels of every perturbation, and the instruction kinds hit."""
    refuted, accepted = [], []
    for label, variant in perturbations(spec, bounds):
        try:
            prove(spec, variant)
        except Refuted:
            refuted.append(label)
            continue
        accepted.append(label)
    kinds = {label.split(" ", 1)[0] for label in refuted + accepted}
    return refuted, accepted, kinds


def _every_kind(bounds) -> set[str]:
    return {(i.kind.value if i.op is None else i.op.kind.value) for i in bounds[-1].plan.instrs} | {
        "rank"
    }


@pytest.mark.parametrize("name", FILES)
def test_a_perturbed_operand_is_refuted_or_runs_right(pool, reference, name):
    text = (REPO / "schedules" / f"{name}.sched").read_text()
    c = compile_text(text, f"{name}.sched")
    bounds = [c.bound(r) for r in range(c.spec.world)]
    refuted, accepted, kinds = _sorted(c.spec, bounds)
    assert kinds == _every_kind(bounds)  # every kind of instruction, and the rank's own
    assert len(refuted) > 2 * len(accepted), accepted
    want = reference(text, STEPS)
    for label in accepted:
        got = pool.run(text, c.spec.world, STEPS, fault=f"mutation perturb {label}", timeout=60)
        assert_matches(got, want)
    for outcome, labels in (("refuted", refuted), ("ran right", accepted)):
        for _ in labels:
            tally("operand perturbations", name, outcome)


@pytest.mark.parametrize("name", list(CASES))
def test_a_perturbed_pipeline_operand_is_refuted_or_runs_right(pool, name):
    case = CASES[name]
    c = compile_text(case.text(), f"<{case}>")
    bounds = [c.bound(r) for r in range(c.spec.world)]
    refuted, accepted, kinds = _sorted(c.spec, bounds)
    assert kinds == _every_kind(bounds)
    assert len(refuted) > 2 * len(accepted), accepted
    for label in accepted:
        wrong = replace(case, mutation=f"perturb {label}")
        per_rank = pool.call("tests.pipeline_ranks:run_case", case.world, wrong, timeout=60)
        assert_matches(merged(replicas(per_rank, case)), reference(case))
    for outcome, labels in (("refuted", refuted), ("ran right", accepted)):
        for _ in labels:
            tally("operand perturbations", name, outcome)

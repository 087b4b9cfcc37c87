"""Each plan-mutation class of issue #44's (tests/plan_mutations.py) run on CPU ranks with
the proof bypassed: the first variant of the class bound into the plans the executor runs
(tests/faults.py `mutation CLASS`), two steps, against the single-process reference. A
class the proof refutes should be really wrong when run: an error, a hang (bounded by the
job's timeout), or an update that differs from the reference's.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/mutants_run.py [CLASS ...]

on the bundled tiny DDP (world 2), FSDP (world 2) and HSDP (2 x 2) schedules, and on
pipelines (tests/pipeline_ranks.py `Case`, nano's width: 1F1B at pp 2 with DDP, FSDP and
HSDP per stage, 1F1B at pp 4, ZB-V), each class on each one it has a variant on, with the
pipeline-only classes the proof of pipelines added (batch-slice: the last stage's targets;
rendezvous-in-a-circle).

Not part of the test suite (a hang costs its whole timeout); docs/proof.md records a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.oracle import assert_matches, reference_steps  # noqa: E402
from tests.pool import JobFailed, Pool  # noqa: E402

SCHEDULES = {  # name: (text, world)
    "ddp": ((ROOT / "schedules" / "tiny_ddp_overlap.sched").read_text(), 2),
    "fsdp": ((ROOT / "schedules" / "tiny_fsdp_prefetch.sched").read_text(), 2),
    "hsdp": ((ROOT / "schedules" / "tiny_hsdp.sched").read_text(), 4),
}
NEW = (  # the classes added for issue #44
    "update-dropped",
    "update-twice",
    "after-update",
    "forward-out-of-order",
    "slice-outside-batch",
    "divisor-zero",
    "bucket-layout",
    "streams-in-a-circle",
    "unit-layout",
)
PIPELINE_ONLY = ("batch-slice", "rendezvous-in-a-circle")
STEPS = 2
TIMEOUT_S = 30


def pipelines() -> dict:
    from schedc.passes.pipeline_gen import Schedule
    from tests.pipeline_ranks import Case

    one_f = Schedule.ONE_F_ONE_B
    return {
        "pp-ddp": Case(one_f, 2, 2, dp=2, buckets=2),
        "pp-fsdp": Case(one_f, 2, 2, dp=2, fsdp=True),
        "pp-hsdp": Case(one_f, 2, 2, dp=4, fsdp=True, replicate=2),  # 8 ranks
        "pp4": Case(one_f, 4, 8),
        "zbv": Case(Schedule.ZB_V, 2, 4, v=2),
    }


def main(argv: list[str]) -> int:
    """Each class (those named, or every new one) on each schedule it has a variant on."""
    from schedc.compiler import compile_text
    from tests.plan_mutations import CLASSES

    compiled = {k: compile_text(text, f"{k}.sched") for k, (text, _) in SCHEDULES.items()}
    cases = {k: (case, compile_text(case.text(), k)) for k, case in pipelines().items()}
    pools: dict[int, Pool] = {}  # a DP x PP case takes a whole pool: one pool a size

    def pool(world: int) -> Pool:
        size = 8 if world > 4 else 4
        if size not in pools:
            pools[size] = Pool(size)
        return pools[size]

    try:
        for cls in argv or NEW + PIPELINE_ONLY:
            for k, (text, world) in SCHEDULES.items():
                c = compiled[k]
                if cls in PIPELINE_ONLY or next(CLASSES[cls](c.spec, list(c.bounds)), None) is None:
                    continue  # no variant here (a bucket in FSDP, a circle without HSDP)
                print(f"{cls:<22} {k:<7} {_run(pool(world), cls, text, world)}", flush=True)
            for k, (case, c) in cases.items():
                if next(CLASSES[cls](c.spec, list(c.bounds)), None) is not None:
                    result = _run_case(pool(case.world), case, cls)
                    print(f"{cls:<22} {k:<7} {result}", flush=True)
    finally:
        for p in pools.values():
            p.close()
    return 0


def _run_case(pool: Pool, case, cls: str) -> str:
    from dataclasses import replace

    from tests.pipeline_ranks import merged, reference, replicas

    case = replace(case, mutation=cls)
    try:
        per_rank = pool.call("tests.pipeline_ranks:run_case", case.world, case, timeout=TIMEOUT_S)
    except JobFailed as e:
        return _failed(e)
    try:
        assert_matches(
            merged(replicas(per_rank, case) if case.dp > 1 else per_rank), reference(case)
        )
    except AssertionError as e:
        return f"wrong: {(str(e).splitlines() or [repr(e)])[0][:160]}"
    return "RAN TO THE REFERENCE: not wrong when run"


def _run(pool: Pool, cls: str, text: str, world: int) -> str:
    try:
        got = pool.run(text, world, STEPS, fault=f"mutation {cls}", timeout=TIMEOUT_S)
    except JobFailed as e:
        return _failed(e)
    try:
        assert_matches(got, reference_steps(text, STEPS))
    except AssertionError as e:
        return f"wrong: {str(e).splitlines()[0][:160]}"
    return "RAN TO THE REFERENCE: not wrong when run"


def _failed(e: JobFailed) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    said = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception")) or
            "did not finish" in x]  # fmt: skip
    return f"fails: {(said[-1] if said else lines[0])[:200]}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

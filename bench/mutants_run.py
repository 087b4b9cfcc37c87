"""Each plan-mutation class of issue #44's (tests/plan_mutations.py) run on CPU ranks with
the proof bypassed: the first variant of the class bound into the plans the executor runs
(tests/faults.py `mutation CLASS`), two steps, against the single-process reference. A
class the proof refutes should be really wrong when run: an error, a hang (bounded by the
job's timeout), or an update that differs from the reference's.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/mutants_run.py [CLASS ...]

on the bundled tiny DDP (world 2), FSDP (world 2) and HSDP (2 x 2) schedules, each class on
each one it has a variant on.

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
STEPS = 2
TIMEOUT_S = 30


def main(argv: list[str]) -> int:
    """Each class (those named, or every new one) on each schedule it has a variant on."""
    from schedc.compiler import compile_text
    from tests.plan_mutations import CLASSES

    compiled = {k: compile_text(text, f"{k}.sched") for k, (text, _) in SCHEDULES.items()}
    pool = Pool(4)
    try:
        for cls in argv or NEW:
            for k, (text, world) in SCHEDULES.items():
                c = compiled[k]
                if next(CLASSES[cls](c.spec, list(c.bounds)), None) is None:
                    continue  # no variant here (a bucket in FSDP, a circle without HSDP)
                print(f"{cls:<22} {k:<5} {_run(pool, cls, text, world)}", flush=True)
    finally:
        pool.close()
    return 0


def _run(pool: Pool, cls: str, text: str, world: int) -> str:
    try:
        got = pool.run(text, world, STEPS, fault=f"mutation {cls}", timeout=TIMEOUT_S)
    except JobFailed as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        said = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception")) or
                "did not finish" in x]  # fmt: skip
        return f"fails: {(said[-1] if said else lines[0])[:200]}"
    try:
        assert_matches(got, reference_steps(text, STEPS))
    except AssertionError as e:
        return f"wrong: {str(e).splitlines()[0][:160]}"
    return "RAN TO THE REFERENCE: not wrong when run"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

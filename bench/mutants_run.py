"""Each plan-mutation class of issue #44's (tests/plan_mutations.py) run on CPU ranks with
the proof bypassed: the first variant of the class bound into the plans the executor runs
(tests/faults.py `mutation CLASS`), two steps, against the single-process reference. A
class the proof refutes should be really wrong when run: an error, a hang (bounded by the
job's timeout), or an update that differs from the reference's.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/mutants_run.py [CLASS ...]

Not part of the test suite (a hang costs its whole timeout); docs/proof.md records a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.oracle import assert_matches, reference_steps  # noqa: E402
from tests.pool import JobFailed, Pool  # noqa: E402

DDP = (ROOT / "schedules" / "tiny_ddp_overlap.sched").read_text()
HSDP = (ROOT / "schedules" / "tiny_hsdp.sched").read_text()
FSDP = (ROOT / "schedules" / "tiny_fsdp_prefetch.sched").read_text()
# (class, schedule text, world): the schedule whose plans the class has variants on
CASES = [
    ("update-dropped", DDP, 2),
    ("update-twice", DDP, 2),
    ("after-update", DDP, 2),
    ("forward-out-of-order", DDP, 2),
    ("slice-outside-batch", DDP, 2),
    ("divisor-zero", DDP, 2),
    ("bucket-layout", DDP, 2),
    ("streams-in-a-circle", HSDP, 4),
    ("unit-layout", FSDP, 2),
]
STEPS = 2
TIMEOUT_S = 30


def main(argv: list[str]) -> int:
    wanted = set(argv) or {c for c, _, _ in CASES}
    pool = Pool(4)
    try:
        for cls, text, world in CASES:
            if cls in wanted:
                print(f"{cls:<22} {_run(pool, cls, text, world)}", flush=True)
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

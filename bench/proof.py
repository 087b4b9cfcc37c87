"""The proof (passes/prove.py): the plan mutations it refutes, per class, and what it costs.

    python bench/proof.py                       # mutation counts, then the cost table
    python bench/proof.py --show CLASS [FILE]   # one mutation of CLASS (tests/plan_mutations.py)
                                                # on FILE's plans, as `schedc check` reports it

Counts: every class of tests/plan_mutations.py on the bundled tiny schedules, the proof
tests' own sources (tests/passes/test_proof.py: FSDP's upcast, recompute with a chunked
loss) and every bundled pipeline schedule, per family; every variant must be refuted.

Cost: `schedc check schedules/gpt2_8gpu.sched` in a fresh process, the median of --repeat
runs, and the proof's own time (its line says it); then the compile of generated GPT-2 XL
DDP and FSDP schedules (bench/compile.py's) at 16 to 128 micro-steps, CPU time of the whole
compile and the proof's, per op: the proof's cost should stay flat per op as the step
grows. A benchmark to read, not a test: it asserts nothing but that every mutation is
refuted.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schedc.compiler import compile_file, compile_source, compile_text  # noqa: E402
from schedc.lang.diagnostics import CompileError, Diagnostics  # noqa: E402
from schedc.lang.read import source_from_text  # noqa: E402
from schedc.passes.check import check_proof  # noqa: E402
from schedc.passes.prove import prove  # noqa: E402
from schedc.passes.prove_rank import Refuted  # noqa: E402
from tests.passes.test_proof import PIPELINES, SOURCES  # noqa: E402
from tests.plan_mutations import CLASSES  # noqa: E402


def show(cls: str, path: str) -> int:
    """Print `schedc check`'s report of the first mutation of `cls` on `path`'s plans."""
    c = compile_file(path)
    bounds = [c.bound(r) for r in range(c.spec.world)]
    label, variant = next(CLASSES[cls](c.spec, bounds))
    print(f"# {cls}: {label}")
    diag = Diagnostics(c.source)
    check_proof(c.spec, variant, diag)
    try:
        diag.raise_if_any()
    except CompileError as e:  # as `schedc check` prints it
        print(e.render(), file=sys.stderr)
        return 1
    return 0


FAMILIES = ("DDP", "FSDP", "HSDP", "pipeline")


def sources() -> dict[str, str]:
    """The proof tests' sources and every bundled pipeline schedule."""
    return {**SOURCES, **PIPELINES}


def family(spec) -> str:
    if spec.pipeline is not None:
        return "pipeline"
    return "HSDP" if spec.hsdp else str(spec.kind).upper()


def counts() -> Counter:
    """Refuted variants per (class, family); any variant the proof accepts stops the run."""
    out: Counter = Counter()
    for name, text in sources().items():
        c = compile_text(text, f"{name}.sched")
        bounds = [c.bound(r) for r in range(c.spec.world)]
        for cls, mutate in CLASSES.items():
            for label, variant in mutate(c.spec, bounds):
                try:
                    prove(c.spec, variant)
                except Refuted:
                    out[cls, family(c.spec)] += 1
                    continue
                raise SystemExit(f"NOT REFUTED: {name}: {cls}: {label}")
    return out


def check_seconds(path: str, repeat: int) -> tuple[float, float]:
    """`schedc check PATH` in fresh processes: the median wall seconds, and the median of
    the proof's milliseconds that its proof line reports."""
    walls, proofs = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "schedc", "check", path],
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout
        walls.append(time.perf_counter() - t0)
        proofs.append(float(re.search(r", ([\d.]+) ms\)", out).group(1)))
    return statistics.median(walls), statistics.median(proofs)


def scaling(repeat: int) -> list[str]:
    from bench.compile import MICRO_STEPS, xl_ddp, xl_fsdp

    rows = ["| schedule | ops a rank | compile (CPU ms) | proof (ms) | proof share | proof us/op |"]
    rows.append("|---|---:|---:|---:|---:|---:|")
    for name, make in (("ddp", xl_ddp), ("fsdp", xl_fsdp)):
        for k in MICRO_STEPS:
            src = source_from_text(make(k), f"xl_{name}_k{k}.sched")
            best, proof, ops = float("inf"), float("inf"), 0
            for _ in range(repeat):
                t0 = time.process_time()
                c = compile_source(src)
                best = min(best, (time.process_time() - t0) * 1e3)
                assert c.proof is not None
                proof = min(proof, c.proof.ms)
                ops = len(c.plan().ops)
            rows.append(
                f"| gpt2-xl {name} k={k} | {ops:,} | {best:,.0f} | {proof:,.0f} | "
                f"{proof / best:.0%} | {proof * 1e3 / (ops * c.spec.world):.1f} |"
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", metavar="CLASS", choices=sorted(CLASSES))
    ap.add_argument("file", nargs="?", default="schedules/tiny_ddp_overlap.sched")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.show:
        return show(args.show, args.file)
    found = counts()
    print(f"plan mutations refuted: {sum(found.values())} of {sum(found.values())}")
    print(f"  {'class':22} " + " ".join(f"{f:>8}" for f in FAMILIES) + "     all")
    for cls in CLASSES:
        row = [found[cls, f] for f in FAMILIES]
        print(f"  {cls:22} " + " ".join(f"{n:>8}" for n in row) + f" {sum(row):>7}")
    path = "schedules/gpt2_8gpu.sched"
    wall, proof_ms = check_seconds(path, args.repeat)
    print(
        f"\n`schedc check {path}` (median of {args.repeat} fresh processes): {wall:.2f} s, "
        f"of which the proof {proof_ms:.0f} ms: +{proof_ms / (wall * 1e3 - proof_ms):.0%} "
        "over the check without it"
    )
    print("\nGPT-2 XL at world 8 (the proof executes every rank's plan, two steps):")
    print("\n".join(scaling(max(1, args.repeat // 2))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

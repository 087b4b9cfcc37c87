"""How `schedc calibrate` and `schedc render --trace --compare --unfold` scale with the trace.

    python bench/trace_scale.py [--schedule schedules/tiny_fsdp_prefetch.sched]
                                [--mib 43 237] [--keep DIR]

Writes traces of the schedule's simulated step (`chrome_trace`, as `schedc run --trace`
writes one: every rank, every op, a `step N` slice) repeated step after step until the file
reaches each size, then runs both verbs on it in a child process and reports the child's
wall time and peak RSS (getrusage). The sizes default to the two the hardening issue
measured: a 43 MB trace of about 2,000 steps and one near the 256 MiB cap. A benchmark to
read, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schedc.analysis.cost import CostModel
from schedc.analysis.simulate import simulate
from schedc.analysis.trace.write import chrome_trace
from schedc.compiler import compile_file


def write_trace(schedule: Path, out: Path, mib: float) -> tuple[int, int]:
    """A trace of `schedule`'s simulated step, repeated until `mib` MiB; (steps, events)."""
    c = compile_file(schedule)
    tl = simulate(c, CostModel())
    length = max(i.end for i in tl.intervals) * 1.05
    first = chrome_trace(tl, step=0, path=str(schedule))
    meta = [e for e in first["traceEvents"] if e["ph"] == "M"]
    body = [e for e in first["traceEvents"] if e["ph"] != "M"]
    target, steps, events = int(mib * (1 << 20)), 0, len(meta)
    with open(out, "w") as f:
        f.write('{"traceEvents": [\n')
        f.write(",\n".join(json.dumps(e) for e in meta))
        while f.tell() < target:
            shift = steps * length * 1e6
            for e in body:
                e2 = dict(e, ts=e["ts"] + shift, args=dict(e.get("args") or {}, step=steps))
                f.write(",\n" + json.dumps(e2))
            steps += 1
            events += len(body)
        f.write('\n], "displayTimeUnit": "ms", "otherData": ')
        f.write(json.dumps(first["otherData"]) + "}\n")
    return steps, events


def measure(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of `python -m schedc ARGV` in a child, its
    own rusage (os.wait4), not the largest of every child so far."""
    t0 = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "schedc", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        print(err.decode(errors="replace")[-2000:], file=sys.stderr)
    return time.perf_counter() - t0, usage.ru_maxrss / 1024, child.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default=str(REPO / "schedules" / "tiny_fsdp_prefetch.sched"))
    ap.add_argument("--mib", type=float, nargs="+", default=[43, 237])
    ap.add_argument("--keep", metavar="DIR", help="write the traces here, and keep them")
    args = ap.parse_args()
    where = Path(args.keep or tempfile.mkdtemp(prefix="schedc-traces-"))
    where.mkdir(parents=True, exist_ok=True)
    print(f"trace scale: {Path(args.schedule).name}, python {sys.version.split()[0]}")
    print("| trace | steps | events | verb | wall | peak RSS |")
    print("|---|---|---|---|---|---|")
    for mib in sorted(args.mib):
        t = where / f"t{mib:g}.json"
        steps, events = write_trace(Path(args.schedule), t, mib)
        size = os.path.getsize(t) / (1 << 20)
        for verb, argv in (
            ("calibrate", ["calibrate", str(t)]),
            (
                "render --compare --unfold",
                [
                    "render",
                    args.schedule,
                    "--trace",
                    str(t),
                    "--compare",
                    "--unfold",
                    "-o",
                    str(where / "t.dot"),
                ],
            ),  # fmt: skip
        ):
            wall, peak, code = measure(argv)
            status = "" if code == 0 else f" (exit {code})"
            print(
                f"| {size:.0f} MiB | {steps:,} | {events:,} | {verb} | {wall:.1f} s{status} "
                f"| {peak:.0f} MiB |",
                flush=True,
            )
        if not args.keep:
            t.unlink()


if __name__ == "__main__":
    main()

"""The must-show of `schedc tune` on this CPU, as one command (docs/tune.md).

    python bench/tune_check.py                       # mini, world 2; prints the whole result
    python bench/tune_check.py --write docs/tune.md  # also records it in that file's section

1. Runs the calibration schedule (default docs/tune/mini_fsdp.sched) and the DDP schedule
   (docs/tune/mini.sched) once each with --trace, and fits the cost model to each trace
   alone (`schedc calibrate`): ONE trace per cost model. The calibration run also times
   every collective kind before its first step (`--probe`; `--no-probe` leaves it out), so
   its one trace prices all-reduces, which an FSDP schedule never runs, and its layers at
   micro 1 (what a micro-step costs whatever its size, which one micro size cannot show).
2. `schedc tune FILE --cost <calibrated on the one trace> --top T --measure K --rounds R`:
   tune picks by prediction alone, runs the best K, R times interleaved (each candidate's
   figure the median of its rounds; their spread is the noise every other figure is read
   against), and states the pick against the fastest measured and the median prediction
   error (its own output, printed as it is).
3. Predicts the same K candidates again with two other cost models: the one fitted to the
   DDP trace alone (does a DDP calibration predict FSDP?) and the two fits merged (each
   parameter the median of the fits that determine it, `tune --measure`'s refit: the
   all-reduce's rates from the DDP trace, the all-gather's and reduce-scatter's from the
   FSDP one, which no single trace at world 2 holds together); for each, the median error
   and which of the K it ranks first. States the DDP schedule's own measured step beside
   the pick (tune measures only its top K; DDP may rank below them).

Every run is `OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone
--nproc_per_node=2 -m schedc run ...`, one after another. Times are medians of the steps
after the first. Nothing here is cached: each call measures afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schedc.analysis.cost import CostModel
from schedc.analysis.simulate import simulate
from schedc.compiler import compile_file  # noqa: E402
from schedc.tune.measure import Run, command, refit, step_time

BEGIN = "<!-- tune_check: begin -->"
END = "<!-- tune_check: end -->"


def sh(cmd: list[str], out: list[str]) -> str:
    """Run a command, echo it and its output (also into `out`), fail loudly."""
    shown = " ".join(cmd).replace(sys.executable, "python")
    print(f"$ {shown}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    text = (p.stdout + p.stderr).rstrip()
    if p.returncode:
        sys.exit(f"failed (exit {p.returncode}):\n{text}")
    out.append(f"$ {shown}")
    return text


def traced(
    file: Path, dest: Path, steps: int, out: list[str], probe: bool = False
) -> tuple[Path, float]:
    trace, log = dest.with_suffix(".trace.json"), dest.with_suffix(".log.jsonl")
    log.unlink(missing_ok=True)
    sh(command(file, compile_file(file).spec.world, steps, trace, log, probe), out)
    return trace, step_time(log)


def load_avg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def runs_once(out: str) -> str:
    """tune's output with its "measuring i/K, round r/R: CMD" lines folded into the first
    and a count: the commands differ only in the candidate and round."""
    lines = out.splitlines()
    runs = [ln for ln in lines if ln.startswith("schedc: measuring ")]
    if len(runs) < 2:
        return out
    at = lines.index(runs[0])
    rest = [ln for ln in lines if not ln.startswith("schedc: measuring ")]
    note = f"schedc: ... {len(runs) - 1} more runs like it, one per candidate and round"
    return "\n".join(rest[:at] + [runs[0], note] + rest[at:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", default="docs/tune/mini_fsdp.sched", type=Path)
    ap.add_argument("--ddp", default="docs/tune/mini.sched", type=Path)
    ap.add_argument("--tune", default="docs/tune/mini.sched", type=Path, help="the file tuned")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="tune --measure's interleaved rounds: each candidate's figure is the median of "
        "its rounds, and their spread is the noise (default 5)",
    )
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--measure", type=int, default=8)
    ap.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="calibrate on the schedule's own ops only (no `schedc run --probe`)",
    )
    ap.add_argument("--dir", type=Path, help="where runs go (default: a temporary folder)")
    ap.add_argument("--write", type=Path, help=f"replace the {BEGIN} section of this file")
    a = ap.parse_args()
    for name in ("calibrate", "ddp", "tune", "dir", "write"):  # as given: from here
        if getattr(a, name) is not None and str(ap.get_default(name)) != str(getattr(a, name)):
            setattr(a, name, getattr(a, name).resolve())
    os.chdir(REPO)  # the defaults, and the commands it prints, are the repository's
    d = a.dir or Path(tempfile.mkdtemp(prefix="tune_check."))
    d.mkdir(parents=True, exist_ok=True)
    cmds: list[str] = []
    t0, load0 = time.time(), load_avg()
    # the calibration trace times every collective kind too (--probe): an FSDP schedule
    # runs no all-reduce, and on gloo an all-gather's byte costs several all-reduce bytes
    cal_trace, cal_step = traced(a.calibrate, d / "cal", a.steps, cmds, probe=a.probe)
    ddp_trace, ddp_step = traced(a.ddp, d / "ddp", a.steps, cmds)
    params, ddp_params = d / "params.json", d / "ddp_params.json"
    fit = sh([sys.executable, "-m", "schedc", "calibrate", str(cal_trace), "-o", str(params)], cmds)
    sh([sys.executable, "-m", "schedc", "calibrate", str(ddp_trace), "-o", str(ddp_params)], cmds)
    top = d / "top"
    tuned = sh(
        [
            sys.executable,
            "-m",
            "schedc",
            "tune",
            str(a.tune),
            "--cost",
            str(params),
            "--top",
            str(a.top),
        ]
        + ["--measure", str(a.measure), "--steps", str(a.steps), "--rounds", str(a.rounds)]
        + ["--write-top", str(top)]
        + ["--fit", str(d / "refit.json")],
        cmds,
    )
    both, _ = refit(
        [
            Run(a.calibrate, cal_trace, d / "cal.log.jsonl"),
            Run(a.ddp, ddp_trace, d / "ddp.log.jsonl"),
        ],
        CostModel(),
    )
    # each candidate: its step in every round (tune's figure is their median)
    tag = [f".r{r}" if a.rounds > 1 else "" for r in range(1, a.rounds + 1)]
    rounds = [[step_time(top / f"{i}{t}.log.jsonl") for t in tag] for i in range(1, a.measure + 1)]
    measured = [statistics.median(rs) for rs in rounds]
    compiled = [compile_file(top / f"{i}.sched") for i in range(1, a.measure + 1)]
    others = []
    for label, cost in (
        ("the DDP trace alone", CostModel.load(ddp_params)),
        ("both traces, merged", both),
    ):
        predicted = [simulate(c, cost).end for c in compiled]
        errs = [(p - m) / m for p, m in zip(predicted, measured)]
        first = min(range(len(predicted)), key=lambda i: predicted[i])
        others.append(
            f"- calibrated on {label} instead, the {a.measure} measured candidates are "
            f"predicted with median |error| {100 * statistics.median(map(abs, errs)):.1f}% "
            f"(signed, in tune's order: {', '.join(f'{100 * e:+.0f}%' for e in errs)}); it "
            f"ranks #{first + 1} first of them, measured {measured[first]:.2f} s, "
            f"{100 * (measured[first] - min(measured)) / min(measured):+.1f}% against the "
            "fastest measured"
        )
    pick = measured[0]
    spreads = [100 * (max(rs) - min(rs)) / statistics.median(rs) for rs in rounds]
    lines = [
        f"2 ranks x 1 thread, load average {load0} at the start and {load_avg()} at the end, "
        f"{time.time() - t0:.0f} s in all.",
        "",
        "```",
        *cmds,
        "```",
        "",
        f"Calibrated on one trace ({a.calibrate}):",
        "",
        "```",
        fit,
        "```",
        "",
        "```",
        runs_once(tuned),
        "```",
        "",
        f"- noise: over its {a.rounds} rounds a candidate's step spread "
        f"{statistics.median(spreads):.0f}% of its median (median over the candidates; "
        f"{min(spreads):.0f}-{max(spreads):.0f}%); the calibration run itself measured "
        f"{cal_step:.2f} s",
        f"- the DDP schedule {a.ddp} measured {ddp_step:.2f} s; the pick by prediction "
        f"{pick:.2f} s ({100 * (pick - ddp_step) / ddp_step:+.1f}% against it)",
        *others,
    ]
    text = "\n".join(lines)
    print("\n" + text)
    if a.write:
        doc = a.write.read_text()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"{a.write} has no {BEGIN} ... {END} section")
        head, rest = doc.split(BEGIN, 1)
        # the runs' folder is this machine's; the docs name it <dir>
        shown = text.replace(str(d), "<dir>")
        doc = head + BEGIN + "\n" + shown + "\n" + END + rest.split(END, 1)[1]
        a.write.write_text(doc)
        print(f"wrote {a.write}")
    json.dump({"rounds": rounds, "ddp": ddp_step, "pick": pick}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

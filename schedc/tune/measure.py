"""`schedc tune --measure K`: run the finalists for real, and fit the cost model to their traces.

    measure(candidates, files, steps, rounds=R)
                                       -> the runs, and each candidate's measured step
                                          (median dt of the steps after the first, which
                                          warms up; with R rounds, the median of its R
                                          runs, interleaved)
    refit(runs, cost)                  -> the cost model fitted to every trace at once

Each candidate is its written schedule run as its own job, one after another (they would
otherwise compete for the same cores), its ranks started by `schedc run` itself:

    OMP_NUM_THREADS=1 python -m schedc run FILE --steps S --trace T --log-json J

A run past --timeout is ended as a user's Ctrl-C would end it: SIGTERM to the launcher,
which ends its ranks, then SIGKILL if it is still there (a rank whose launcher is killed
leaves by itself: exec/launcher.py). Nothing here imports torch; the runs do.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.analysis.calibrate import calibrate
from schedc.analysis.cost import CostModel
from schedc.analysis.simulate import simulate
from schedc.analysis.trace.schema import TraceError
from schedc.analysis.trace.stream import load
from schedc.analysis.units import fmt_time
from schedc.compiler import compile_file
from schedc.errors import UserError
from schedc.tune.pipeline import PipeCandidate
from schedc.tune.search import Candidate


@dataclass(frozen=True)
class Run:
    file: Path
    trace: Path
    log: Path


@dataclass(frozen=True)
class Timing:
    """A candidate's measured step, seconds: each round's run (its median step), in round
    order, and the median over them."""

    rounds: tuple[float, ...]

    @property
    def step(self) -> float:
        return statistics.median(self.rounds)


def command(
    file: Path, world: int, steps: int, trace: Path, log: Path, probe: bool = False
) -> list[str]:
    """`schedc run` of `file` with a trace and a JSON log; `probe`: the trace also times every
    collective kind (`--probe`, at world > 1), for a calibration that prices them all."""
    run = ["-m", "schedc", "run", str(file), "--steps", str(steps)]
    run += ["--trace", str(trace), "--log-json", str(log)]
    if probe and world > 1:
        run.append("--probe")
    return [sys.executable, *run]


GRACE_S = 10.0  # how long a launcher past --timeout has to end its ranks after SIGTERM


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str] | None:
    """Run `cmd` to the end: (exit status, its output), or None past `timeout` seconds, when
    it is ended (SIGTERM, then SIGKILL after GRACE_S) before returning."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        return None
    return p.returncode, out


def measure(
    cands: Sequence[Candidate | PipeCandidate],
    files: list[Path],
    steps: int,
    timeout: float,
    echo=print,
    rounds: int = 1,
) -> tuple[list[Run], list[Timing]]:
    """Run each candidate's file, `rounds` times, interleaved (round 1 runs every candidate
    once, then round 2 ..., each round starting one candidate later, so that none is always
    the first after a pause), so that a machine that speeds up or slows down over the
    minutes this takes moves every candidate's figure alike: every run, and each candidate's
    Timing. A failed run is a user error naming the file and the end of its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: list[Run] = []
    times: list[list[float]] = [[] for _ in cands]
    K = len(cands)
    for r in range(rounds):
        for i in [(r + j) % K for j in range(K)]:  # each round starts one candidate later
            cand, file = cands[i], files[i]
            stem = file.parent / (file.stem + (f".r{r + 1}" if rounds > 1 else ""))
            run = Run(file, Path(f"{stem}.trace.json"), Path(f"{stem}.log.jsonl"))
            run.log.unlink(missing_ok=True)
            cmd = command(file, cand.spec.world, steps, run.trace, run.log)
            what = f"{i + 1}/{len(cands)}" + (f", round {r + 1}/{rounds}" if rounds > 1 else "")
            echo(f"schedc: measuring {what}: python {' '.join(cmd[1:])}")
            done = run_bounded(cmd, env, timeout)
            if done is None:
                raise UserError(f"--measure: {file} ran past {timeout:g} s (ended)")
            if done[0] != 0:
                tail = failure_tail(done[1])
                raise UserError(f"--measure: {file} failed (exit {done[0]}):\n{tail}")
            times[i].append(step_time(run.log))
            runs.append(run)
    return runs, [Timing(tuple(ts)) for ts in times]


def failure_tail(output: str, lines: int = 12) -> str:
    """The end of a failed run's output, which says why (the ranks' last lines, and the
    launcher's word on a rank killed by a signal)."""
    return "\n".join(output.strip().splitlines()[-lines:])


def step_time(log: Path) -> float:
    """The median step of a run's --log-json records, the first step (warm-up) left out
    when there are more."""
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    dts = [r["dt_ms"] / 1e3 for r in records if not r.get("skipped")]
    if not dts:
        raise UserError(f"--measure: {log} holds no steps")
    return statistics.median(dts[1:] if len(dts) > 1 else dts)


def refit(runs: list[Run], cost: CostModel) -> tuple[CostModel, list[str]]:
    """`schedc calibrate`'s fit on every trace, each parameter the median over the traces
    that measured it (each trace fits its own rates; the median keeps one slow run from
    pulling the rest; a DDP trace measures no all-gather, an FSDP trace no all-reduce)."""
    fits, notes = [], []
    for run in runs:
        try:
            fit = calibrate(compile_file(run.file), load(run.trace), base=cost, name=str(run.trace))
        except TraceError as e:
            notes.append(f"{run.trace}: {e}")
            continue
        fits.append(fit)
    if not fits:
        return cost, notes
    keys = ["bandwidth", "latency", "mem_bandwidth", "free", "overhead", "grad_bandwidth"]
    keys += ["norm_bandwidth", "inter_bandwidth"]
    keys += [f"{w}_{p}" for w in ("gather", "scatter") for p in ("bandwidth", "latency")]
    values = {}
    for k in keys:
        # the traces that measured k have the say (a DDP trace's all-reduce sets bandwidth,
        # not an FSDP trace's stand-in for it); else every trace that has a value for it
        # (a term a fit dropped, grad_bandwidth None, is no value to take a median of)
        every = [(k in f.measured, getattr(f.cost, k)) for f in fits]
        have = [v for m, v in every if m and v is not None] or [
            v for _, v in every if v is not None
        ]
        values[k] = statistics.median(have) if have else None
    rates: dict[str, list[float]] = {}
    for f in fits:  # each trace fits the rate of its own compute dtype
        rates.setdefault(f.compute_key, []).append(getattr(f.cost, f.compute_key))
    values.update({k: statistics.median(v) for k, v in rates.items()})
    return replace(cost, flops=None, **{k: v for k, v in values.items() if v is not None}), notes


def repredict(cands: list[Candidate], cost: CostModel) -> list[float]:
    return [simulate(c.checked, cost).end for c in cands]


def pick_vs_fastest(timings: list[Timing]) -> list[str]:
    """How much slower the predicted best (#1) ran than the fastest measured, in words."""
    fastest = min(range(len(timings)), key=lambda i: timings[i].step)
    pick, best = timings[0], timings[fastest]
    out = [
        f"the pick by prediction (#1) measured {fmt_time(pick.step)}; the fastest measured "
        f"(#{fastest + 1}) {fmt_time(best.step)}: the pick is "
        f"{100 * (pick.step / best.step - 1):.1f}% slower"
    ]
    if len(pick.rounds) > 1 and fastest != 0:
        # the same round ran both, minutes apart at most: the ratio cancels the machine's drift
        paired = sorted(a / b for a, b in zip(pick.rounds, best.rounds))
        out.append(
            f"paired by round, the pick took {paired[0]:.2f}-{paired[-1]:.2f}x the fastest's "
            f"time (median {statistics.median(paired):.2f}x over {len(paired)} rounds)"
        )
    return out


def error(predicted: float, measured: float) -> float:
    """Relative error of a prediction, signed: + predicted slower than measured."""
    return (predicted - measured) / measured

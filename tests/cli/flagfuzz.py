"""A fuzz of every verb's flags: hostile values never reach a traceback, a hang, or a value
silently ignored.

    python -m tests.cli.flagfuzz [--cases 600] [--seed 0]      # every verb, run included

Each case is one verb on a legal baseline (a bundled schedule, a simulated trace) with one to
three of its flags (read off the real argparse parser, so a flag added later is fuzzed too)
set to values from a pool of the odd: empty, blank, signs, non-finite, huge, tiny, units of
the wrong kind, 300-byte names, /proc, /dev/zero, a FIFO, a directory, a missing file,
a file of bad or deeply nested JSON. A case fails when:

- it exits 2 or prints a traceback or "internal error" (an internal error);
- it runs past its time limit (a hang);
- it exits 0 although a value was empty, blank, or not a finite number where the flag is
  not a file name (a value silently ignored).

check, render, calibrate and tune run in this process through `schedc.cli.main.main`
(milliseconds a case); `run` runs as `python -m schedc run` in a child with --steps 1 on
the one-process schedule. tests/cli/test_flag_fuzz.py runs 300 cases of the in-process
verbs in the suite; this script's default of 600 covers `run` as well
(docs/benchmarks.md records a run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.goldens import REPO
from tests.ranks import python

DDP, ONE = "tiny_ddp_overlap.sched", "tiny_1gpu.sched"  # copies, in the fuzz's own folder
IN_PROCESS = ("check", "render", "calibrate", "tune")
LIMIT_S = {"run": 120, "tune": 60}  # a case past its limit is a hang; others: 30 s
# flags whose value names a file to write: any text but an empty one may be a file name
OUTPUTS = {"-o", "--output", "--trace", "--log-json", "--save", "--write-top", "--fit"}
JUNK = {"", " ", "\t", "nan", "inf", "-inf", "1e400", "NaN", "Infinity"}  # never a value


@dataclass
class Case:
    verb: str
    argv: list[str]
    changed: list[tuple[str, str]]  # (flag, value) the fuzz set


@dataclass
class Outcome:
    case: Case
    code: int | None  # None: it hung
    err: str
    seconds: float

    @property
    def failure(self) -> str | None:
        if self.code is None:
            return "hang"
        if self.code == 2 or "Traceback" in self.err or "internal error" in self.err:
            return "internal error"
        if self.code == 0:
            for flag, value in self.case.changed:
                if value.strip() == "" or (value in JUNK and flag not in OUTPUTS):
                    return f"{flag} {value!r} silently ignored"
        return None


def flags_of(verb: str) -> list[tuple[str, bool]]:
    """(flag, takes a value) of every optional flag `schedc VERB` has."""
    from schedc.cli.main import build_parser

    ap = build_parser()
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    out = []
    for a in sub.choices[verb]._actions:
        if isinstance(a, argparse._HelpAction) or not a.option_strings:
            continue
        out.append((max(a.option_strings, key=len), a.nargs != 0))
    return out


class Fixtures:
    """The files the cases point at, made once in a temporary directory."""

    def __init__(self, root: Path):
        self.root = root
        for name in (DDP, ONE):  # a case may write over its inputs: never the repository's
            (root / name).write_text((REPO / "schedules" / name).read_text())
        self.trace = root / "t.json"
        self.trace.write_text(json.dumps(simulated_trace(str(root / DDP))))
        self.dir = root / "adir"
        self.dir.mkdir()
        self.fifo = root / "fifo"
        os.mkfifo(self.fifo)
        self.bad_json = root / "bad.json"
        self.bad_json.write_text('{"traceEvents": [')
        self.deep_json = root / "deep.json"
        self.deep_json.write_text("[" * 50_000)
        self.bad_sched = root / "bad.sched"
        self.bad_sched.write_text("model tiny\nworld 2\nbatch 8 x 64\nmicro 3\n")
        self.params = root / "params.json"
        self.params.write_text('{"flops_tf32": 3e11, "bandwidth": 2e9}')
        self.key = root / "key"
        self.key.write_bytes(bytes(range(32)))
        self.n = 0

    def fresh(self, suffix: str) -> str:
        self.n += 1
        return str(self.root / f"out{self.n}{suffix}")

    def values(self) -> list[str]:
        return [
            *JUNK,
            "-1",
            "0",
            "1",
            "2",
            "3",
            "-5",
            "1.5",
            "1e-300",
            "9" * 40,
            "abc",
            "é",
            "-",
            "--",
            "on",
            "off",
            "bf16",
            "fp32",
            "ddp,fsdp",
            "fsdp",
            "gpt2",
            "tiny",
            "1KiB",
            "80GiB",
            "9999999999TiB",
            "10us",
            "300T",
            "100GB/s",
            "mb1:mb2",
            "70ms:90ms",
            "mb9:",
            ":",
            "x" * 300 + ".svg",
            "/proc/schedc-fuzz.svg",
            "/dev/zero",
            str(self.fifo),
            str(self.dir),
            str(self.root / "missing" / "x.json"),
            str(self.trace),
            str(self.bad_json),
            str(self.deep_json),
            str(self.bad_sched),
            DDP,
            ONE,
            self.fresh(".svg"),
            self.fresh(".dot"),
            self.fresh(".json"),
            self.fresh(""),
        ]

    def plausible(self, verb: str, flag: str) -> list[str]:
        """Values `flag` may well take, so that a case also runs with it (a fuzz whose
        every value is refused would never see one ignored)."""
        fresh = self.fresh
        return {
            "--dump": ["plan", "ast", "program", "graph"],
            "--rank": ["0", "1"],
            "--model": ["tiny", "nano"],
            "--steps": ["1", "2"],
            "--seed": ["0", "7"],
            "--precision": ["bf16", "fp32"] + (["fp32,bf16"] if verb == "tune" else []),
            "--tf32": ["on", "off"],
            "--compile": ["off"] if verb == "run" else ["on", "off"],
            "--view": ["timeline", "graph"],
            "--trace": [str(self.trace)] if verb == "render" else [fresh(".json")],
            "--step": ["0"],
            "--window": ["mb1:", "mb0:mb1", "0ms:1ms"],
            "--cost": [str(self.params)],
            "--flops": ["300T", "1e12"],
            "--bandwidth": ["100GB/s", "5e9"],
            "--inter-bandwidth": ["10G"],
            "--node-size": ["1", "4"],
            "--latency": ["10us", "0"],
            "--output": [fresh(".dot"), fresh(".svg")]
            if verb == "render"
            else [fresh(".json")]
            if verb == "calibrate"
            else [fresh(".sched")],
            "--schedule": [DDP],
            "--budget": ["80GiB", "64 MiB"],
            "--top": ["3", "1"],
            "--strategy": ["ddp", "fsdp", "ddp,fsdp"],
            "--write-top": [fresh("")],
            "--fit": [fresh(".json")],
            "--rounds": ["2"],
            "--timeout": ["30"],
            "--device": ["cpu", "auto"],
            "--save": [fresh("")],
            "--save-every": ["1"],
            "--keep": ["0", "1"],
            "--resume": [fresh("")],
            "--checkpoint-key": [str(self.key)],
            "--nonfinite": ["skip", "stop"],
            "--log-json": [fresh(".jsonl")],
        }.get(flag, ["1"])

    def baseline(self, verb: str) -> list[str]:
        return {
            "check": [DDP],
            "render": [DDP, "-o", self.fresh(".dot")],
            "calibrate": [str(self.trace), "--schedule", DDP],
            "tune": [DDP, "--top", "2"],
            "run": [ONE, "--steps", "1"],
        }[verb]


def simulated_trace(schedule: str) -> dict:
    """A trace as `schedc run --trace` writes one, of the schedule's simulated step (no torch)."""
    from schedc.analysis.simulate import simulate
    from schedc.analysis.trace.write import chrome_trace
    from schedc.compiler import compile_file

    return chrome_trace(simulate(compile_file(schedule)), path=schedule)


def cases(n: int, seed: int, verbs: tuple[str, ...], fx: Fixtures) -> list[Case]:
    rng = random.Random(seed)
    flags = {v: flags_of(v) for v in verbs}
    out = []
    for i in range(n):
        verb = verbs[i % len(verbs)]
        argv, changed = [verb, *fx.baseline(verb)], []
        for flag, takes in rng.sample(flags[verb], min(len(flags[verb]), rng.randint(1, 3))):
            if not takes:
                argv.append(flag)
                continue
            if verb == "tune" and flag == "--measure":  # measuring runs jobs: only bad counts
                value = rng.choice(["", " ", "-1", "0", "nan", "abc", "1e400"])
            elif rng.random() < 0.6:
                value = rng.choice(fx.plausible(verb, flag))
            else:
                value = rng.choice(fx.values())
            argv += [flag, value]
            changed.append((flag, value))
        out.append(Case(verb, argv, changed))
    return out


class _Hang(Exception):
    pass


def run_in_process(case: Case, cwd: Path) -> Outcome:
    """The case through `schedc.cli.main.main` in this process, in `cwd`, under an alarm."""
    from schedc.cli.main import main

    err, t0 = io.StringIO(), time.perf_counter()

    def ring(*_):
        raise _Hang

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(LIMIT_S.get(case.verb, 30))
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(case.argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    except _Hang:
        code = None
    finally:
        os.chdir(here)
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(case, code, err.getvalue(), time.perf_counter() - t0)


def run_in_child(case: Case, cwd: Path) -> Outcome:
    t0 = time.perf_counter()
    try:
        limit = LIMIT_S.get(case.verb, 30)
        r = python("-m", "schedc", *case.argv, env={"OMP_NUM_THREADS": "1"}, cwd=cwd, timeout=limit)
        code, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        code, err = None, (e.stderr or b"").decode(errors="replace")
    return Outcome(case, code, err, time.perf_counter() - t0)


def fuzz(n: int, seed: int, verbs: tuple[str, ...], root: Path) -> list[Outcome]:
    fx = Fixtures(root)
    return [
        run_in_process(c, root) if c.verb in IN_PROCESS else run_in_child(c, root)
        for c in cases(n, seed, verbs, fx)
    ]


def summary(outcomes: list[Outcome]) -> str:
    by_verb: dict[str, list[int]] = {}
    for o in outcomes:
        counts = by_verb.setdefault(o.case.verb, [0, 0, 0])
        counts[0 if o.code == 0 else 1] += 1
        counts[2] += o.failure is not None
    parts = [f"{v}: {a + b} ({a} ran, {b} refused, {f} failed)" for v, (a, b, f) in by_verb.items()]
    bad = [o for o in outcomes if o.failure]
    return f"{len(outcomes)} cases, {len(bad)} failures; " + "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbs", default="check,render,calibrate,tune,run")
    args = ap.parse_args()
    verbs = tuple(args.verbs.split(","))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        outcomes = fuzz(args.cases, args.seed, verbs, Path(d))
    for o in outcomes:
        if o.failure:
            print(f"FAIL ({o.failure}): schedc {' '.join(o.case.argv)}\n{o.err[-1500:]}")
    print(summary(outcomes))
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(
        f"in {time.perf_counter() - t0:.0f} s; slowest case {slowest.seconds:.1f} s: "
        f"schedc {' '.join(slowest.case.argv)[:200]}"
    )
    return 1 if any(o.failure for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())

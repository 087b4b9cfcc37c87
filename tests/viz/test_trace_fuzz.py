"""Bad traces and bad -o paths: `schedc render --trace` and `calibrate` give one clear user
error (exit 1) naming the field and event, never an internal error (exit 2) or a traceback.

The crafted cases are issue 14's; the fuzz mutates a real trace, written once by
`schedc run --trace` at world 1 (real collectives, no torchrun), 2,000+ times: types, deleted
keys, NaN/inf/huge/negative values, duplicated and shuffled events, truncated JSON text. Every
case goes through the real CLI entry point in-process (`schedc.cli.main`); only the schedule's
compile is cached, since it is the same schedule every time.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import random
import time

import pytest

import schedc.cli.calibrate
import schedc.cli.render
import schedc.compiler
from schedc.cli.main import main


@pytest.fixture()
def cached_compile(monkeypatch):
    """The schedule compiles once per test instead of once per call (the fuzz's cost)."""
    cached = functools.lru_cache(None)(schedc.compiler.compile_file)
    for verb in (schedc.cli.render, schedc.cli.calibrate):
        monkeypatch.setattr(verb, "compile_file", cached)


def events(real_trace) -> list[dict]:
    return json.loads((real_trace / "t.json").read_text())["traceEvents"]


def _op_span(e) -> bool:
    """An "X" event that is an op's span (not a `step N` slice, which schedc does not read)."""
    return e["ph"] == "X" and e.get("cat") != "step"


def first_x(evs) -> int:
    return next(i for i, e in enumerate(evs) if _op_span(e))


def last_x(evs) -> int:
    return max(i for i, e in enumerate(evs) if _op_span(e))


def cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.err


def with_event(real_trace, index, change) -> str:
    """The real trace as JSON text with `change(event)` applied to one event (first_x/last_x)."""
    data = json.loads((real_trace / "t.json").read_text())
    evs = data["traceEvents"]
    change(evs[index(evs)])
    return json.dumps(data)  # NaN and Infinity as JavaScript literals, which json accepts


def setter(key, value):
    return lambda e: e.__setitem__(key, value)


def deleter(key):
    return lambda e: e.pop(key)


# name -> (JSON text from the real trace dir, what the error must say)
CRAFTED = {
    "traceEvents of ints": (
        lambda d: '{"traceEvents": [1, 2, 3]}',
        "t.json: traceEvents[0]: expected an object, got 1",
    ),
    "missing ts": (lambda d: with_event(d, first_x, deleter("ts")), ".ts: expected a finite "),
    "string ts": (
        lambda d: with_event(d, first_x, setter("ts", "abc")),
        '.ts: expected a finite number >= 0 (microseconds, at most 1e+18), got "abc"',
    ),
    "NaN ts": (
        lambda d: with_event(d, first_x, setter("ts", math.nan)),
        ".ts: expected a finite number >= 0 (microseconds, at most 1e+18), got NaN",
    ),
    "inf ts": (lambda d: with_event(d, first_x, setter("ts", math.inf)), "got Infinity"),
    "-inf dur": (lambda d: with_event(d, first_x, setter("dur", -math.inf)), ".dur: expected"),
    "bool ts": (lambda d: with_event(d, first_x, setter("ts", True)), ".ts: expected"),
    "string pid": (
        lambda d: with_event(d, first_x, setter("pid", "0")),
        '.pid: expected a rank, an integer >= 0, got "0"',
    ),
    "pid past the world": (lambda d: with_event(d, last_x, setter("pid", 7)), ".pid: rank 7, but "),
    "negative dur": (
        lambda d: with_event(d, first_x, setter("dur", -1.5)),
        ".dur: expected a finite number >= 0",
    ),
    "huge ts": (lambda d: with_event(d, first_x, setter("ts", 1e300)), "got 1e+300"),
    "huge int ts": (lambda d: with_event(d, first_x, setter("ts", 10**400)), "(401 digits)"),
    "5000-digit int": (lambda d: '{"traceEvents": [' + "9" * 5000 + "]}", "t.json: not JSON"),
    "1e999 literal": (
        lambda d: with_event(d, first_x, setter("dur", 1)).replace('"dur": 1,', '"dur": 1e999,'),
        ".dur: expected a finite number >= 0",
    ),
    "args a list": (
        lambda d: with_event(d, first_x, setter("args", [1])),
        ".args: expected an object, got a list",
    ),
    "string step": (
        lambda d: with_event(d, last_x, lambda e: e["args"].update(step="1")),
        '.args.step: expected an integer >= 0, got "1"',
    ),
    "stream a number": (
        lambda d: with_event(d, first_x, lambda e: e["args"].update(stream=3)),
        ".args.stream: expected a name",
    ),
    "unknown stream": (
        lambda d: with_event(d, last_x, lambda e: e["args"].update(stream="nccl")),
        "stream 'nccl' is none of",
    ),
    "a lone surrogate in an op": (
        lambda d: with_event(d, last_x, setter("name", "fwd[\ud800]@mb0")),
        "rank 0 ran fwd[\\ud800]@mb0, which",
    ),
    "missing ph": (lambda d: with_event(d, first_x, deleter("ph")), ".ph: expected a string"),
    "thread_name without args": (
        lambda d: with_event(d, lambda evs: 2, deleter("args")),
        "traceEvents[2].args: expected an object, got nothing",
    ),
    "deep lists": (lambda d: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "deep objects": (lambda d: '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    "empty file": (lambda d: "", "t.json: not JSON"),
    "not JSON": (lambda d: "this is not a trace\n", "t.json: not JSON"),
    "a list of garbage": (lambda d: '[1, "x", null, []]', "t.json: [0]: expected an object"),
    "a string": (lambda d: '"traceEvents"', "expected a JSON object with a traceEvents list"),
    "no traceEvents": (
        lambda d: '{"events": []}',
        "traceEvents: expected a list of events, got nothing",
    ),
    "traceEvents an object": (lambda d: '{"traceEvents": {}}', "got an object"),
    "no op spans": (lambda d: '{"traceEvents": []}', "holds no op spans"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_trace_is_one_clear_error(real_trace, tmp_path, capsys, case):
    make, says = CRAFTED[case]
    t = tmp_path / "t.json"
    t.write_text(make(real_trace))
    sched, out = real_trace / "w1.sched", tmp_path / "m.dot"
    for argv in (
        ["render", sched, "--trace", t, "-o", out],
        ["render", sched, "--trace", t, "--compare", "-o", out],
        ["calibrate", t, "--schedule", sched],
    ):
        code, err = cli(capsys, *argv)
        assert code == 1, (argv, err)
        assert err.startswith("schedc: error: ") and says in err, err
        assert "Traceback" not in err and "--window" not in err
        assert len(err.splitlines()) == 1, err
    assert not out.exists()  # the -o check's probe leaves nothing behind


def test_a_schedule_name_in_the_trace_is_checked(real_trace, tmp_path, capsys):
    data = json.loads((real_trace / "t.json").read_text())
    for bad, says in (
        (5, "otherData.schedule: expected a file name, got 5"),
        ("a\0b", "otherData.schedule: expected a file name"),
        (str(tmp_path), "[io]"),  # the compiler's error: a directory
        (str(tmp_path / "gone.sched"), "which is not here"),
    ):
        data["otherData"]["schedule"] = bad
        (tmp_path / "t.json").write_text(json.dumps(data))
        code, err = cli(capsys, "calibrate", tmp_path / "t.json")
        assert code == 1 and says in err and "Traceback" not in err, err


def test_special_files_as_traces_return_at_once(real_trace, tmp_path, capsys):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, says in (
        (fifo, "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (tmp_path, "cannot read trace"),
        (tmp_path / "nothing.json", "No such file"),
    ):
        t0 = time.monotonic()
        code, err = cli(capsys, "calibrate", path, "--schedule", real_trace / "w1.sched")
        assert code == 1 and says in err, err
        code, err = cli(
            capsys, "render", real_trace / "w1.sched", "--trace", path, "-o", tmp_path / "m.dot"
        )
        assert code == 1 and says in err, err
        assert time.monotonic() - t0 < 30  # generous: a FIFO used to block forever


def bad_outputs(tmp_path) -> list[tuple[str, str]]:
    (tmp_path / "adir.dot").mkdir()
    (tmp_path / "afile").write_text("")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    out = [
        (tmp_path / "adir.dot", "is a directory"),
        (tmp_path / "missing" / "m.dot", "no such directory"),
        (tmp_path / "afile" / "m.dot", "not a directory"),
        # root writes anywhere os.access says; /proc refuses even root a new file
        ("/proc/schedc-test.dot" if os.geteuid() == 0 else ro / "m.dot", "cannot write"),
    ]
    return [(str(p), says) for p, says in out]


def test_bad_render_outputs_are_refused_before_any_work(real_trace, tmp_path, capsys):
    # the schedule and the trace do not exist: the -o check must come first to be seen
    for out, says in bad_outputs(tmp_path):
        for extra in ([], ["--trace", tmp_path / "none.json"]):
            code, err = cli(capsys, "render", tmp_path / "none.sched", *extra, "-o", out)
            assert code == 1 and err.startswith(f"schedc: error: -o {out}: {says}"), err
            assert "Traceback" not in err and "none.sched" not in err
    code, err = cli(capsys, "render", real_trace / "w1.sched", "-o", tmp_path / "m.txt")
    assert code == 1 and "the extension says the format" in err  # as before


def test_bad_calibrate_outputs_are_refused_before_any_work(real_trace, tmp_path, capsys):
    for out, says in bad_outputs(tmp_path):
        code, err = cli(capsys, "calibrate", tmp_path / "none.json", "-o", out)
        assert code == 1 and err.startswith(f"schedc: error: -o {out}: {says}"), err
        assert "Traceback" not in err
    code, err = cli(
        capsys,
        "calibrate",
        real_trace / "t.json",
        "--schedule",
        real_trace / "w1.sched",
        "-o",
        tmp_path / "p.json",
    )
    fitted = json.loads((tmp_path / "p.json").read_text())  # the traced dtype's rate
    assert code == 0 and any(k.startswith("flops") and (v or 0) > 0 for k, v in fitted.items())


# -- the fuzz --------------------------------------------------------------------------------------

CASES = 2000
ODD = [
    None,
    True,
    False,
    0,
    -1,
    -1e-9,
    1,
    2**31,
    10**30,
    1e18,
    1e19,
    1e308,
    5e-324,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "abc",
    "12",
    "compute",
    "comm",
    "fwd[h.0]@mb0",
    "allreduce[b1]@mb1",
    "bwd[h.9]@mb0",
    "optimizer.step",
    "free[b1]@mb0:fwd",
    [],
    [1],
    {},
    {"step": 1},
    {"name": 3},
    [[[[[]]]]],
    "fwd[\ud800\u202e]@mb0",
    "x" * 300,
]


def mutate(rng: random.Random, data: dict) -> str:
    """One to three mutations of the trace, as JSON text (sometimes cut or corrupted)."""
    for _ in range(rng.randint(1, 3)):
        evs = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(evs, list) or not evs:
            break
        _mutate_once(rng, data, evs)
    return _as_text(rng, data)


def _mutate_once(rng: random.Random, data: dict, evs: list) -> None:
    i = rng.randrange(len(evs))
    e = evs[i]
    what = rng.randrange(10)
    if what == 6:  # an event replaced by something that is not one
        evs[i] = copy.deepcopy(rng.choice(ODD))
    elif what == 7:  # duplicated, dropped, or shuffled events
        how = rng.randrange(3)
        if how == 0:
            evs.insert(rng.randrange(len(evs)), copy.deepcopy(e))
        elif how == 1:
            evs.pop(i)
        else:
            rng.shuffle(evs)
    elif what == 9:
        if isinstance(data, dict):
            _mutate_envelope(rng, data)
    elif isinstance(e, dict):
        _mutate_fields(rng, e, what)


def _mutate_fields(rng: random.Random, e: dict, what: int) -> None:
    """what < 5: a field, or a field of args, gets an odd value; 5: a key deleted; 8: a
    time stretched or squeezed."""
    if what < 5:
        target = e["args"] if what == 4 and isinstance(e.get("args"), dict) else e
        key = rng.choice(
            sorted(target, key=str) + ["ts", "dur", "pid", "tid", "step", "stream", "name", "args"]
        )
        target[key] = copy.deepcopy(rng.choice(ODD))
    elif what == 5 and e:
        e.pop(rng.choice(sorted(e, key=str)))
    elif what == 8 and isinstance(e.get("ts"), (int, float)):
        e[rng.choice(["ts", "dur"])] = rng.choice([0, 1e-300, 1e17, 3.7e5, 1e15])


def _mutate_envelope(rng: random.Random, data: dict) -> None:
    rng.choice(
        [
            lambda: data.pop("otherData", None),
            lambda: data.__setitem__("traceEvents", copy.deepcopy(rng.choice(ODD))),
            lambda: data.__setitem__("otherData", copy.deepcopy(rng.choice(ODD))),
            lambda: data.__setitem__("displayTimeUnit", rng.choice(ODD)),
        ]
    )()


def _as_text(rng: random.Random, data: dict | list) -> str:
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list) and rng.random() < 0.05:
        data = data["traceEvents"]  # Chrome's JSON Array Format, which schedc also reads
    text = json.dumps(data)
    cut = rng.random()
    if cut < 0.08:  # truncated, as a run killed mid-write leaves it
        text = text[: rng.randrange(len(text))]
    elif cut < 0.14:  # one character overwritten
        k = rng.randrange(len(text))
        text = text[:k] + rng.choice('0-.e"[]{},:N\\ x\u00e9') + text[k + 1 :]
    return text


def test_fuzzed_traces_never_crash(real_trace, tmp_path, capsys, cached_compile):
    """2,000 mutated traces through render --trace (timeline, --compare every other time)
    and calibrate: exit 0 or 1, never 2, no traceback; the counts are printed."""
    rng = random.Random(14)
    base = json.loads((real_trace / "t.json").read_text())
    sched, t, out = real_trace / "w1.sched", tmp_path / "t.json", tmp_path / "m.dot"
    counts = {"render": [0, 0], "calibrate": [0, 0]}
    t0 = time.monotonic()
    for n in range(CASES):
        t.write_text(mutate(rng, copy.deepcopy(base)))
        runs = {
            "render": ["render", sched, "--trace", t, "-o", out, *(["--compare"] if n % 2 else [])],
            "calibrate": ["calibrate", t, "--schedule", sched],
        }
        if n % 7 == 0:
            runs["render"] += ["--step", rng.choice(["0", "1", "5"])]
        for verb, argv in runs.items():
            code, err = cli(capsys, *argv)
            assert code in (0, 1), f"case {n}: {verb} exit {code}\n{t.read_text()[:2000]}\n{err}"
            assert "Traceback" not in err, f"case {n}: {err}"
            if code == 1:
                assert err.startswith("schedc: error: ") and len(err.splitlines()) == 1, err
            counts[verb][code] += 1
    took = time.monotonic() - t0
    with capsys.disabled():
        print(
            f"\nfuzz: {CASES} traces in {took:.1f} s; "
            + "; ".join(f"{v}: {ok} accepted, {bad} rejected" for v, (ok, bad) in counts.items())
        )
    assert all(sum(c) == CASES for c in counts.values())
    # the mutations must reach both sides: traces drawn and traces refused
    assert min(c[0] for c in counts.values()) >= 100
    assert min(c[1] for c in counts.values()) >= 500

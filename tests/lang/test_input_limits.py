"""Reading schedules and data files safely, and diagnostics bounded in count and size.

Issue 14 found `schedc check` hanging on a FIFO, /dev/zero and /dev/urandom (the size check
read st_size, 0 for them; /dev/zero took 2 GB in 5 s), and a file under 1 MiB that repeats
one mistake on one long line growing memory with the square of the count until the kernel
killed it. The limits the issue states are tried through the real CLI, one subprocess each,
with its peak RSS taken from wait4 (what /usr/bin/time -v reports); the rest in-process.
The bound asserted is generous (20 s, 300 MB) for a loaded 2-core machine; the figures are
printed (`pytest -s`) so a slowdown shows before it fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from schedc.compiler import compile_text
from schedc.files import NotRegularFile, read_limited
from schedc.lang.diagnostics import (
    EXCERPT_COLUMNS,
    MAX_KEPT,
    MAX_SHOWN,
    CompileError,
    Diagnostic,
    Diagnostics,
    Severity,
    render_all,
)
from schedc.lang.parse import MAX_TOKENS
from schedc.lang.read import MAX_SOURCE_BYTES, read_source, source_from_bytes, source_from_text
from tests.goldens import REPO

MiB = 1 << 20
OK = "model nano world 1 batch 8 x 32 micro 8\n"
BASE = "model nano world 2 batch 8 x 32 micro 2\n"
TIME_LIMIT_S, RSS_LIMIT_MB = 20.0, 300.0


# -- the CLI, timed and weighed -------------------------------------------------------------------


# Measures `python -m schedc check` from a small parent. The peak RSS a child reports counts
# what its process held before exec, and a child forked from pytest (torch loaded) starts at
# pytest's size; forked from this shim it starts at a bare interpreter's, as under time -v.
_SHIM = """
import os, subprocess, sys, time
cmd, err, limit = sys.argv[1:-2], sys.argv[-2], float(sys.argv[-1])
with open(err, "wb") as f:
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f)
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - t0 > limit:
            p.kill()
            pid, status, usage = os.wait4(p.pid, 0)
            break
        time.sleep(0.02)
print(os.waitstatus_to_exitcode(status), time.monotonic() - t0, usage.ru_maxrss)
"""


def check_cli(path: str | Path, tmp_path: Path) -> tuple[int, str, float, float]:
    """`python -m schedc check PATH`: exit status, stderr, seconds, peak RSS in MB.

    Killed at TIME_LIMIT_S (the test then fails on the time); the RSS is the child's own,
    from wait4 (RUSAGE_CHILDREN would give the largest of every child so far)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), NO_COLOR="1")
    err = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "schedc", "check", str(path)]
    r = subprocess.run(
        [sys.executable, "-c", _SHIM, *cmd, str(err), str(TIME_LIMIT_S)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT_S + 30,
        check=True,
    )
    rc, seconds, rss_kb = r.stdout.split()
    stderr = err.read_text(encoding="utf-8", errors="replace")
    rss_mb = int(rss_kb) / 1024  # KiB on Linux
    print(
        f"\n  schedc check {path}: exit {rc}, {float(seconds):.2f} s, "
        f"peak RSS {rss_mb:.0f} MB, {len(stderr):,} bytes of stderr"
    )
    return int(rc), stderr, float(seconds), rss_mb


def assert_bounded(rc: int, seconds: float, rss_mb: float) -> None:
    assert seconds < TIME_LIMIT_S, f"schedc check ran {seconds:.1f} s"
    assert rc == 1, f"exit {rc}: a user error exits 1"
    assert rss_mb < RSS_LIMIT_MB, f"peak RSS {rss_mb:.0f} MB"


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.sched"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "directory"])
def test_special_files_are_refused_at_once(kind, fifo, tmp_path):
    path = {"fifo": fifo, "directory": tmp_path}.get(kind, kind)
    if not os.path.exists(path):
        pytest.skip(f"no {path} here")
    rc, err, seconds, rss = check_cli(path, tmp_path)
    assert_bounded(rc, seconds, rss)
    what = {"fifo": "a FIFO (named pipe)", "directory": "a directory"}.get(
        kind, "a character device"
    )
    assert err.splitlines() == [
        f"{path}: error: cannot read file: it is {what}, not a regular file  [io]",
        "1 error",
    ]


def _fill(
    unit: str, head: str = "", tail: str = "", *, tokens: int | None = None, per_unit: int = 1
) -> str:
    """head + unit repeated to just under 1 MiB (or to `tokens` tokens) + tail, one line."""
    n = (MAX_SOURCE_BYTES - 64 - len(head) - len(tail)) // len(unit)
    if tokens is not None:
        n = min(n, tokens // per_unit)
    return head + unit * n + tail


# One mistake repeated on one line, each under 1 MiB. The parse stops past MAX_TOKENS, so the
# costliest files are those just under it that compile through to the resolver: 25,000
# unknown names, 50,000 ops naming no layer (each distinct, so no suggestion is cached).
_NEAR = MAX_TOKENS - 50
REPEATED = {
    "syntax-token": (_fill("world ? "), "unexpected '?'", 1),
    "duplicate-setting": (BASE + _fill("seed 1 "), "file-too-large", 1),
    "unknown-name-past-the-limit": (
        BASE + _fill("x, ", "ddp { bucket b1 = ", "head }\n"),
        "more than 50,000 tokens",
        1,
    ),
    "unknown-name-near-the-limit": (
        BASE + _fill("x, ", "ddp { bucket b1 = ", "head }\n", tokens=_NEAR, per_unit=2),
        "unknown layer or parameter 'x'",
        _NEAR // 2,
    ),
    "duplicate-near-the-limit": (
        OK + _fill("seed 1 ", tokens=_NEAR, per_unit=2),
        "'seed' is given twice",
        _NEAR // 2 - 1,
    ),
    "distinct-ops-near-the-limit": (
        OK + "program compute { " + "".join(f"bwd[q{i}]@mb0 " for i in range(_NEAR)) + "}\n",
        "unknown layer 'q0'",
        _NEAR,
    ),
    "long-comment-line": (
        "#" + "a" * (MAX_SOURCE_BYTES - 100) + "\nworld ?\n",
        "unexpected '?'",
        1,
    ),
    "megabyte-name": ("model " + "a" * (MAX_SOURCE_BYTES - 100) + "\n", "unknown model", 4),
}


@pytest.mark.parametrize("name", REPEATED)
def test_one_mistake_repeated_on_one_line(name, tmp_path):
    text, says, errors = REPEATED[name]
    path = tmp_path / f"{name}.sched"
    path.write_text(text)
    assert path.stat().st_size <= MAX_SOURCE_BYTES
    rc, err, seconds, rss = check_cli(path, tmp_path)
    assert_bounded(rc, seconds, rss)
    assert says in err
    lines = err.splitlines()
    assert lines[-1] == f"{errors:,} error{'s' if errors != 1 else ''}"
    shown = sum(1 for line in lines if ": error: " in line)
    assert shown == min(errors, MAX_SHOWN)
    if errors > MAX_SHOWN:
        assert lines[-2] == (
            f"... and {errors - MAX_SHOWN:,} more errors "
            f"(the first {MAX_SHOWN} by position are shown)"
        )
    # every line printed is short: excerpts are windows, messages are cut
    assert max(len(line) for line in lines) < EXCERPT_COLUMNS + 500
    assert len(err) < 100_000


def test_a_good_file_still_exits_0(tmp_path):
    path = tmp_path / "ok.sched"
    path.write_bytes(b"\xef\xbb\xbf" + OK.replace("\n", "\r\n").encode())
    rc, err, _, _ = check_cli(path, tmp_path)
    assert rc == 0, err


# -- reading: regular files only, the limit on the bytes read ---------------------------------


@pytest.fixture
def alarm():
    """Fail, not hang, if a read blocks (an open of a FIFO without O_NONBLOCK would)."""

    def ring(*_):
        raise TimeoutError("blocked reading a special file")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_the_type_is_taken_from_the_open_descriptor(fifo, monkeypatch, alarm):
    """A path that passes the first look and is a FIFO when opened (swapped in between) is
    still refused, by fstat of the descriptor, and the open does not wait for a writer."""
    regular = os.stat(__file__)
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: regular)  # the first look lies
    with pytest.raises(NotRegularFile, match="it is a FIFO"):
        read_limited(fifo, 100)


def test_a_socket_is_refused(tmp_path, alarm):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(CompileError) as info:
            read_source(path)
    [d] = info.value.diagnostics
    assert (d.code, d.message) == ("io", "cannot read file: it is a socket, not a regular file")


def test_the_limit_holds_on_bytes_read_not_on_st_size():
    """/proc files are regular with st_size 0: the bytes read count, not the size said."""
    proc = Path("/proc/self/status")
    if not proc.exists():
        pytest.skip("no /proc")
    assert proc.stat().st_size == 0
    assert len(read_limited(proc, 10)) == 11  # limit + 1: over the limit
    assert read_source(proc).text.startswith("Name:")  # and read whole


def test_the_size_limit_is_exact(tmp_path):
    path = tmp_path / "big.sched"
    path.write_bytes(OK.encode() + b"#" * (MAX_SOURCE_BYTES - len(OK)))
    assert read_source(path).text.startswith(OK)  # exactly the limit: read
    with open(path, "ab") as f:
        f.write(b"#")
    with pytest.raises(CompileError) as info:
        read_source(path)
    [d] = info.value.diagnostics
    assert d.code == "file-too-large"
    assert (
        d.message == f"file is {MAX_SOURCE_BYTES + 1:,} bytes; a schedule is at most "
        f"{MAX_SOURCE_BYTES:,}"
    )


@pytest.mark.torch  # schedc.model.data makes tensors
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "directory", "socket"])
def test_data_text_files_are_regular_files_only(kind, fifo, tmp_path, alarm):
    from schedc.model import data

    path = {"fifo": fifo, "directory": tmp_path, "socket": tmp_path / "d.sock"}.get(kind, kind)
    if kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    elif not os.path.exists(path):
        pytest.skip(f"no {path} here")
    try:
        with pytest.raises(data.DataError, match=r"it is a .*, not a regular file") as err:
            data.load_tokens(path, "text")
    finally:
        if kind == "socket":
            sock.close()
    assert str(err.value).startswith(f"{path}: ")


@pytest.mark.torch
def test_data_text_limit_on_bytes_read(tmp_path, monkeypatch):
    from schedc.model import data

    path = tmp_path / "book.txt"
    path.write_text("the same words " * 8)
    monkeypatch.setattr(data, "MAX_TEXT_BYTES", 8 * 15)
    assert data.load_tokens(path, "text").size > 0
    monkeypatch.setattr(data, "MAX_TEXT_BYTES", 8 * 15 - 1)
    with pytest.raises(data.DataError, match=r"book\.txt: a text file .* write its GPT-2 ids"):
        data.load_tokens(path, "text")


# -- bounded diagnostics ---------------------------------------------------------------------------


def test_a_stage_keeps_max_kept_and_counts_the_rest():
    src = source_from_text(BASE)
    diag = Diagnostics(src)
    for _ in range(MAX_KEPT + 7):
        diag.error("duplicate", "seed is given twice", src.span(0, 5))
    diag.warning("bucket-order", "kept: warnings have a budget of their own")
    assert len(diag.errors) == MAX_KEPT and diag.unkept_errors == 7 and diag.full
    assert len(diag.warnings) == 1
    with pytest.raises(CompileError) as info:
        diag.raise_if_any()
    e = info.value
    assert e.error_count == MAX_KEPT + 7
    assert e.render().splitlines()[-1] == (
        f"... and {MAX_KEPT + 8 - MAX_SHOWN:,} more "
        f"errors (the first {MAX_SHOWN} by position are "
        "shown)"
    )


def test_rendering_waits_until_asked(monkeypatch):
    calls = []
    real = Diagnostic.render
    monkeypatch.setattr(
        Diagnostic, "render", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    src = source_from_text(BASE)
    e = CompileError([Diagnostic("syntax", f"m{i}", src.span(i, i + 1)) for i in range(500)], src)
    assert calls == []  # raising it rendered nothing
    text = str(e)
    assert len(calls) == MAX_SHOWN
    assert text.splitlines()[-1].startswith(f"... and {500 - MAX_SHOWN} more errors")


def _caret_column(rendered: str) -> tuple[str, int]:
    lines = rendered.splitlines()
    return lines[1], lines[2].index("^")


def test_a_long_line_is_shown_as_a_window_around_the_caret():
    line = "world 1 " * 20_000 + "world ? world 1"
    src = source_from_text(line + "\n")
    pos = line.index("?")
    d = Diagnostic("syntax", "unexpected '?'", src.span(pos, pos + 1))
    shown, caret = _caret_column(d.render(src))
    assert shown[caret] == "?"  # the caret is under the character the span starts at
    assert "..." in shown[:12] and shown.endswith("...") is False  # the line's end is shown
    assert len(shown) <= EXCERPT_COLUMNS + 20
    start = Diagnostic("syntax", "x", src.span(0, 5))  # at the start: no left marker
    shown, caret = _caret_column(start.render(src))
    assert shown.startswith("  1 | world 1") and shown.endswith("...") and shown[caret] == "w"
    short = source_from_text(OK)  # a line under the limit is shown whole, as before
    assert _caret_column(Diagnostic("syntax", "x", short.span(6, 10)).render(short)) == (
        f"  1 | {OK.rstrip()}",
        12,
    )


def test_control_characters_do_not_reach_the_terminal():
    src = source_from_text("world ? # \x1b[2J\u202e\x07\n")
    shown, caret = _caret_column(Diagnostic("syntax", "x", src.span(6, 7)).render(src))
    assert shown[caret] == "?" and "\x1b" not in shown and "\u202e" not in shown
    assert shown.endswith("# \ufffd[2J\ufffd\ufffd")


def test_warnings_print_bounded():
    src = source_from_text(OK)
    ws = [
        Diagnostic("bucket-order", f"w{i}", src.span(0, 1), severity=Severity.WARNING)
        for i in range(60)
    ]
    lines = render_all(ws, src).splitlines()
    assert lines[-1] == f"... and 10 more diagnostics (the first {MAX_SHOWN} by position are shown)"


# -- lexical: byte-order mark, line endings, digits of other scripts ------------------------------


def _error(data: bytes) -> Diagnostic:
    with pytest.raises(CompileError) as info:
        compile_text_bytes(data)
    return info.value.diagnostics[0]


def compile_text_bytes(data: bytes):
    from schedc.compiler import compile_source

    return compile_source(source_from_bytes(data, "t.sched"))


def test_a_byte_order_mark_is_skipped_and_moves_no_column():
    compile_text_bytes(b"\xef\xbb\xbf" + OK.encode())
    bad = OK.replace("micro 8", "micro ?").encode()
    plain, marked = _error(bad), _error(b"\xef\xbb\xbf" + bad)
    assert (marked.span.line, marked.span.col) == (plain.span.line, plain.span.col) == (1, 39)
    # a byte offset in an encoding message still counts the mark, as a hex dump would
    e = _error(b"\xef\xbb\xbfmodel\r\nnano \xff")
    assert e.message == "byte 0xff at offset 15 is not UTF-8 text"  # 3 + 5 + 2 + 5
    assert (e.span.line, e.span.col) == (2, 6)


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_line_endings_give_the_right_line_and_column(newline):
    text = "model nano\nworld 1\n\nbatch 8 x 32\n  micro ?\n".replace("\n", newline)
    with pytest.raises(CompileError) as info:
        compile_text(text, "t.sched")
    [d] = info.value.diagnostics
    assert (d.span.line, d.span.col) == (5, 9)
    assert info.value.render().splitlines()[1:3] == ["  5 |   micro ?", "    |         ^"]


@pytest.mark.parametrize(
    "digit",
    ["\uff12", "\u0662", "\u0968", "\U0001d7d0"],
    ids=["fullwidth", "arabic-indic", "devanagari", "math-bold"],
)
@pytest.mark.parametrize(
    "where",
    ["world {}", "world 1{}", "batch {} x 32", "memory {} MiB", "model nano {{ n_layer = {} }}"],
)
def test_digits_of_other_scripts_are_not_numbers(digit, where):
    stmt = where.format(digit)
    with pytest.raises(CompileError) as info:
        compile_text(OK + stmt + "\n", "t.sched")
    [d] = info.value.diagnostics
    assert d.code == "syntax" and d.message.startswith(f"'{digit}' (")
    assert d.message.endswith("is not a digit schedc reads")
    assert d.hint == "write numbers with the ASCII digits 0-9"
    assert (d.span.line, d.span.col) == (2, stmt.index(digit) + 1)


def test_ascii_digits_still_read():
    assert compile_text(OK + "seed 42\n").spec.seed == 42

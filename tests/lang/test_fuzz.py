"""Bad input never shows a traceback: every outcome is a compiled schedule or a CompileError.

Fixed nasty cases (empty, binary, enormous numbers, a 10 MB file, ...) and hypothesis
feeding random text, random sequences of the grammar's own tokens, and random edits
(delete, duplicate, swap tokens) of the bundled schedules. Each example must also finish
in bounded time. The default profile is derandomized, so a run is reproducible.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedc.compiler import compile_source, compile_text
from schedc.lang.diagnostics import CODES, CompileError
from schedc.lang.parse import parser
from schedc.lang.read import read_source, source_from_bytes
from schedc.lang.resources import bundled_schedules
from tests.goldens import REPO

# per example: a guard against hangs and blow-ups (quadratic time, runaway recursion), not a
# speed target; bench/compile.py measures speed (a typical example takes milliseconds)
LIMIT_S = 20.0

# on top of the session's hypothesis profile (tests/conftest.py: `ci`, the default, is
# derandomized; `long` is random and ten times larger), at least 150 examples per test
FUZZ = settings(
    max_examples=max(150, settings().max_examples),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def outcome(text: str) -> str:
    """'ok' or the codes of the CompileError; any other exception fails the test."""
    start = time.perf_counter()
    try:
        compile_text(text, "fuzz.sched")
        result = "ok"
    except CompileError as e:
        assert e.diagnostics and all(d.code in CODES for d in e.diagnostics)
        assert any(d.is_error for d in e.diagnostics)
        e.render()  # rendering must not fail either
        result = " ".join(e.codes)
    elapsed = time.perf_counter() - start
    assert elapsed < LIMIT_S, f"{elapsed:.2f}s to compile {text[:300]!r}"
    return result


def codes_of(text: str) -> list[str]:
    with pytest.raises(CompileError) as info:
        compile_text(text, "fuzz.sched")
    return info.value.codes


NANO = "model nano\nworld 1\nbatch 8 x 32\nmicro 2\n"


# -- fixed cases --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, code",
    [
        ("", "missing-setting"),
        ("   \n\t\n", "missing-setting"),
        ("# just a comment", "missing-setting"),
        ("modle nano", "syntax"),
        ("model nano world 1 batch 8 x 32 micro 2 ddp {", "unclosed"),
        ("model nano world 1 batch 8 x 32 micro 2 ddp { bucket b = embed .. head", "unclosed"),
        ("}", "syntax"),
        ("{{{{", "syntax"),
        ('data "unterminated', "syntax"),
        ("model nano world 1e40 batch 8 x 32 micro 2", "value-range"),
        (f"model nano world {10**30} batch 8 x 32 micro 2", "value-range"),
        (f"model nano world 1 batch {10**30} x 32 micro 2", "value-range"),
        ("model nano world 1 batch 8 x 32 micro 2 memory 1e400 GiB", "value-range"),
        ("model nano world 1 batch 8 x 32 micro 2 optimizer adamw { lr = 1e400 }", "value-range"),
        (f"model nano world {'9' * 5000} batch 8 x 32 micro 2", "value-range"),
        (NANO + "program compute { fwd[embed]@mb" + "9" * 5000 + " }", "syntax"),
        ("model nano world 0 batch 8 x 32 micro 2", "value-range"),
        ("model nano world 1 batch 0 x 32 micro 2", "value-range"),
        ("model nano world 1 batch 8 x 32 micro 0", "value-range"),
        ("model nano world -2 batch 8 x 32 micro 2", "value-range"),
        ("model nano world 1 batch -8 x -32 micro -2", "value-range"),
        ("model nano { n_layer = 0 } world 1 batch 8 x 32 micro 2", "value-range"),
        ("model nano world 1 batch 8 x 32 micro 2 memory 0 B", "value-range"),
        ("model nano world 2 batch 8 x 32 micro 2 ddp { bucket_cap 0 MiB }", "value-range"),
        (
            "model nano world 2 batch 8 x 32 micro 2 fsdp { unit all = embed .. head "
            "prefetch forward -1 }",
            "value-range",
        ),
        ("model nano world 1 world 1 batch 8 x 32 micro 2", "duplicate"),
        (
            "model nano world 2 batch 8 x 32 micro 2 ddp { bucket b = embed .. head "
            "bucket b = head }",
            "duplicate",
        ),
        ("model nano world 1 batch 2147483647 x 1 micro 1", "value-range"),  # 2**31-1 micro-steps
        (
            "model nano world 2 batch 2147483647 x 1 micro 1 ddp { bucket_cap 1 MiB }",
            "batch-arithmetic",
        ),
        (
            "model nano world 1 batch 8 x 32 micro 2 program compute { fwd[h.0]@mb0 after "
            "fwd[h.0]@mb0 }",
            "missing-op",
        ),
    ],
)
def test_nasty_input_is_a_diagnostic(text, code):
    start = time.perf_counter()
    assert code in codes_of(text)
    assert time.perf_counter() - start < LIMIT_S


def test_a_number_of_thousands_of_digits_is_out_of_range():
    with pytest.raises(CompileError) as info:
        compile_text(f"model nano world {'9' * 5000} batch 8 x 32 micro 2", "fuzz.sched")
    [d] = info.value.diagnostics
    assert d.message == "world must be <= 65,536, got 99999999999999999999..."


def test_binary_bytes_are_an_encoding_error():
    for data in (b"\x89PNG\r\n\x1a\n\x00\x00", bytes(range(256)), b"model nano\xc3"):
        with pytest.raises(CompileError) as info:
            compile_source(source_from_bytes(data, "bin.sched"))
        assert info.value.codes == ["encoding"]


def test_a_10_mb_file_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.sched"
    with big.open("wb") as f:
        f.truncate(10 * 1024 * 1024)  # sparse: nothing to read, and reading is not attempted
    start = time.perf_counter()
    with pytest.raises(CompileError) as info:
        read_source(big)
    assert info.value.codes == ["file-too-large"]
    assert "10,485,760 bytes" in info.value.diagnostics[0].message
    assert time.perf_counter() - start < LIMIT_S  # refused by size, not after reading 10 MB


def test_a_directory_is_an_io_error(tmp_path):
    with pytest.raises(CompileError) as info:
        read_source(tmp_path)
    assert info.value.codes == ["io"]


# -- hypothesis ----------------------------------------------------------------------------------

# the grammar's own keywords and punctuation, and words that mean something to schedc
KEYWORDS = sorted({t.pattern.value for t in parser().terminals if t.pattern.type == "str"})
WORDS = [
    "nano",
    "tiny",
    "gpt2",
    "gpt2-xl",
    "embed",
    "head",
    "h.0",
    "h.1",
    "h.99",
    "wte.weight",
    "wpe.weight",
    "b1",
    "b2",
    "u1",
    "tied",
    "compute",
    "comm",
    "corpus",
    "adamw",
    "lr",
    "n_layer",
    "0",
    "1",
    "2",
    "8",
    "32",
    "-1",
    "0.5",
    "1e40",
    str(10**30),
    "MiB",
    "KiB",
    "B",
    '"data.txt"',
    "#",
    "\n",
    "fwd[h.0]@mb0",
    "bwd[embed]@mb1",
    "allreduce[b1]@mb1",
    "allgather[u1]@mb0:fwd",
    "free[u1]@mb0:bwd",
    "reducescatter[u1]@mb0",
    "optimizer.step",
]
TOKENS = KEYWORDS + WORDS
BUNDLED = [p.read_text() for p in bundled_schedules()]


def split(text: str) -> list[str]:
    """Tokens and the whitespace between them, so edits keep tokens apart."""
    return re.findall(r"\s+|\S+", text)


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    outcome(text)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data):
    try:
        source = source_from_bytes(data, "fuzz.sched")
    except CompileError as e:
        assert e.codes == ["encoding"]
        return
    outcome(source.text)


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_random_token_sequences(tokens):
    outcome(" ".join(tokens))


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=30))
def test_random_statements_after_a_valid_header(tokens):
    outcome(NANO + " ".join(tokens))


EDIT = st.tuples(
    st.sampled_from(["delete", "duplicate", "swap", "insert"]),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.sampled_from(TOKENS),
)


@FUZZ
@given(st.sampled_from(range(len(BUNDLED))), st.lists(EDIT, min_size=1, max_size=4))
def test_random_edits_of_bundled_schedules(which, edits):
    parts = split(BUNDLED[which])
    words = [i for i, p in enumerate(parts) if not p.isspace()]
    for op, a, b, token in edits:
        i, j = words[a % len(words)], words[b % len(words)]
        if op == "delete":
            parts[i] = " "
        elif op == "duplicate":
            parts[i] = f"{parts[i]} {parts[i]}"
        elif op == "swap":
            parts[i], parts[j] = parts[j], parts[i]
        else:
            parts[i] = f"{token} {parts[i]}"
    outcome("".join(parts))


HEADS = [  # small schedules whose written programs the next test breaks
    "model nano world 2 batch 8 x 32 micro 2\n"
    "ddp { bucket b1 = head, h.1  bucket b2 = h.0, embed }\n",
    "model nano world 2 batch 8 x 32 micro 2\n"
    "ddp { bucket b1 = head, h.1  bucket b2 = h.0, embed  no_sync off }\n",
    "model nano world 2 batch 8 x 32 micro 2\n"
    "fsdp { unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head }\n",
    "model nano world 2 batch 8 x 32 micro 2\n"
    "fsdp { unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head\n"
    "       prefetch forward 0  prefetch backward 2  reshard_after_forward off  no_sync on }\n",
]


def _written(head: str) -> list[tuple[str, list[str]]]:

    blocks: list[tuple[str, list[str]]] = []
    for line in compile_text(head).dump("program").splitlines():
        if line.startswith("program "):
            blocks.append((line.split()[1], []))
        elif line != "}":
            blocks[-1][1].append(line.strip())
    return blocks


PROGRAM_EDIT = st.tuples(
    st.sampled_from(["delete", "swap", "drop-after", "add-after", "insert", "move-stream"]),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)


@FUZZ
@given(
    st.sampled_from(range(len(HEADS))),
    st.lists(PROGRAM_EDIT, min_size=1, max_size=5),
    st.lists(st.sampled_from([None, 0, 1]), min_size=2, max_size=2),
)
def test_random_edits_of_written_programs(which, edits, ranks):
    """The checker's rules on hand-edited programs: wrong order, waits, streams and ranks."""
    blocks = _written(HEADS[which])
    ops = [x.split(" after ")[0] for _, lines in blocks for x in lines]
    for op, a, b, c in edits:
        stream, lines = blocks[a % len(blocks)]
        if not lines:
            continue
        i, j = b % len(lines), c % len(lines)
        if op == "delete":
            del lines[i]
        elif op == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "drop-after":
            lines[i] = lines[i].split(" after ")[0]
        elif op == "add-after":
            lines[i] = f"{lines[i].split(' after ')[0]} after {ops[c % len(ops)]}"
        elif op == "insert":
            lines.insert(i, ops[c % len(ops)])
        else:
            blocks[c % len(blocks)][1].append(lines.pop(i))
    text = HEADS[which]
    for (stream, lines), rank in zip(blocks, ranks):
        on = f" on rank {rank}" if rank is not None else ""
        text += f"program {stream}{on} {{\n" + "".join(f"  {x}\n" for x in lines) + "}\n"
    outcome(text)


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"modle nano\n",
        b"\xff\xfe\x00binary",
        b"model nano world 1 batch 8 x 32 micro 2 ddp {",
        b"model nano world 1 batch 1e40 x 32 micro 2",
    ],
    ids=["typo", "binary", "unclosed", "huge"],
)
def test_cli_on_bad_files_exits_1_without_a_traceback(tmp_path, content):
    bad = tmp_path / "bad.sched"
    bad.write_bytes(content)
    for args in (
        ["check", str(bad)],
        ["check", str(bad), "--dump", "plan"],
        ["check", "schedules/tiny_1gpu.sched", str(bad)],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "schedc", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr
        assert r.stderr.startswith(f"{bad}:")
        assert r.stderr.rstrip().endswith("1 error")


def test_cli_on_a_missing_file_exits_1(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "schedc", "check", str(tmp_path / "nope.sched")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "cannot read file: No such file or directory  [io]" in r.stderr
    assert "Traceback" not in r.stderr

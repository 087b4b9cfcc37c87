"""docs/diagnostics.md says what schedc reports, and every example in it reports exactly that.

- Every code in schedc.lang.diagnostics.CODES has a `#### `code`` heading under Examples
  with at least one example that produces it; no code is exempt (none is produced only at
  run time: start-up agreement and checkpoint failures are run errors without a code).
- A ```sched-error CODE``` or ```sched-warning CODE``` block is checked as example.sched
  with `schedc check`; its errors (or its warnings, with exit 0) are exactly CODE, and the
  ```text``` block after it is what the command prints on stderr, line for line.
- A ```console CODE...``` block is a shell session: each `$ ` line runs in bash, in an empty
  directory that holds `schedules/` (a link to the bundled ones), with `schedc` on PATH;
  the lines under it are its output (stdout and stderr). The last command exits 1 with
  exactly the codes listed.
- The first block of the file, an excerpt, is the early-reduce example's output.
- The table of codes is generated from CODES and the modules that report them.
- Every repository path and `schedc.` name the document mentions exists (shell sessions
  aside: an `io` example names a file that is not there).

`SCHEDC_REGEN=1 python -m pytest tests/test_docs_diagnostics.py` rewrites the outputs and
the table.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from schedc.cli.main import main
from schedc.lang.diagnostics import CODES
from tests.goldens import REPO

DOC = REPO / "docs" / "diagnostics.md"
REGEN = os.environ.get("SCHEDC_REGEN") == "1"

FENCE = re.compile(r"^```([\w-]*)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
HEADER = re.compile(r"^\S.*?: (error|warning): .*  \[([\w-]+)\]$", re.M)
EXAMPLE_KINDS = {"sched-error", "sched-warning", "console"}


@dataclass(frozen=True)
class Block:
    kind: str
    codes: tuple[str, ...]
    body: str
    start: int  # offsets of the body in the document
    end: int
    line: int


def blocks(doc: str) -> list[Block]:
    return [
        Block(
            m.group(1),
            tuple(m.group(2).split()),
            m.group(3),
            m.start(3),
            m.end(3),
            doc.count("\n", 0, m.start()) + 1,
        )
        for m in FENCE.finditer(doc)
    ]


def examples() -> list[tuple[int, Block]]:
    """(index among all blocks, block) of every example."""
    return [(i, b) for i, b in enumerate(blocks(DOC.read_text())) if b.kind in EXAMPLE_KINDS]


EXAMPLES = [pytest.param(i, id=f"line{b.line}-{b.kind}-{'-'.join(b.codes)}") for i, b in examples()]


def rewrite(index: int, body: str) -> None:
    """Replace the body of block `index` (SCHEDC_REGEN=1)."""
    doc = DOC.read_text()
    b = blocks(doc)[index]
    DOC.write_text(doc[: b.start] + body + doc[b.end :])


def steady(text: str) -> str:
    """The text without what differs from run to run: the proof's milliseconds."""
    return re.sub(r"(abstract execution of \d+ plans?), [\d.]+ ms\)", r"\1, N ms)", text)


def codes_in(output: str) -> tuple[set[str], set[str]]:
    """The codes of the errors and of the warnings a report holds."""
    found: dict[str, set[str]] = {"error": set(), "warning": set()}
    for severity, code in HEADER.findall(output):
        found[severity].add(code)
    return found["error"], found["warning"]


def check_example(text: str, tmp_path: Path, monkeypatch, capsys) -> tuple[int, str]:
    """`schedc check example.sched` on the text: its exit code and what it prints on stderr."""
    (tmp_path / "example.sched").write_text(text)
    monkeypatch.chdir(tmp_path)
    code = main(["check", "example.sched"])
    return code, capsys.readouterr().err


def run_session(body: str, tmp_path: Path) -> tuple[str, int, str]:
    """Run a console block's commands; returns the transcript, the last exit code and the
    last command's output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "schedc").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m schedc "$@"\n')
    (bin_dir / "schedc").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "schedules").symlink_to(REPO / "schedules")
    (work / "bench").symlink_to(REPO / "bench")  # bench/proof.py --show (the `proof` code)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "NO_COLOR": "1",
    }
    commands = [line[2:] for line in body.splitlines() if line.startswith("$ ")]
    assert commands, "a console block runs at least one `$ ` command"
    transcript, rc, out = [], 0, ""
    for cmd in commands:
        r = subprocess.run(
            ["bash", "-c", cmd],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        rc, out = r.returncode, r.stdout
        transcript.append(f"$ {cmd}\n{out}")
    return "".join(transcript), rc, out


@pytest.mark.parametrize("index", EXAMPLES)
def test_example(index, tmp_path, monkeypatch, capsys):
    all_blocks = blocks(DOC.read_text())
    b = all_blocks[index]
    assert b.codes and set(b.codes) <= set(CODES), f"line {b.line}: unknown codes {b.codes}"
    if b.kind == "console":
        transcript, rc, out = run_session(b.body, tmp_path)
        errors, warnings = codes_in(out)
        assert rc == 1, transcript
        assert errors == set(b.codes) and not warnings, transcript
        if REGEN and steady(b.body) != steady(transcript):
            rewrite(index, transcript)
            return
        assert steady(b.body) == steady(transcript), (
            "the session's output differs; SCHEDC_REGEN=1 rewrites it"
        )
        return
    assert len(b.codes) == 1, f"line {b.line}: a schedule example shows one code"
    out_block = all_blocks[index + 1] if index + 1 < len(all_blocks) else None
    assert out_block is not None and out_block.kind == "text", (
        f"line {b.line}: an example is followed by a ```text block of what it prints"
    )
    rc, err = check_example(b.body, tmp_path, monkeypatch, capsys)
    errors, warnings = codes_in(err)
    if b.kind == "sched-error":
        assert rc == 1 and errors == set(b.codes), err
    else:
        assert rc == 0 and not errors and warnings == set(b.codes), err
    if REGEN and out_block.body != err:
        rewrite(index + 1, err)
        return
    assert out_block.body == err, "the example's output differs; SCHEDC_REGEN=1 rewrites it"


def test_every_code_has_an_example_under_its_heading():
    doc = DOC.read_text()
    section = doc[doc.index("\n## Examples\n") :]
    headings = list(re.finditer(r"^#### `([\w-]+)`$", section, re.M))
    assert [h.group(1) for h in headings] == list(CODES), "one heading per code, in CODES order"
    for h, nxt in zip(headings, [*headings[1:], None]):
        part = section[h.end() : nxt.start() if nxt else len(section)]
        own = [b for b in blocks(part) if b.kind in EXAMPLE_KINDS]
        assert own, f"`{h.group(1)}` has no example"
        assert all(h.group(1) in b.codes for b in own), f"`{h.group(1)}`: {own}"
    produced = {c for _, b in examples() for c in b.codes}
    assert produced == set(CODES)


def test_the_opening_excerpt_is_the_early_reduce_example():
    all_blocks = blocks(DOC.read_text())
    first = all_blocks[0]
    assert first.kind == "text"
    [shown] = [all_blocks[i + 1].body for i, b in examples() if b.codes == ("early-reduce",)]
    if REGEN and first.body != shown:
        rewrite(0, shown)
        return
    assert first.body == shown, "the opening excerpt is the early-reduce example's output"


def test_no_fence_is_misspelled():
    kinds = {b.kind for b in blocks(DOC.read_text())}
    assert kinds <= EXAMPLE_KINDS | {"text", ""}, kinds


# -- the table of codes ---------------------------------------------------------------------------

STAGES = {
    "lang/read.py": "read",
    "lang/parse.py": "parse",
    "lang/resolve": "resolve",  # a package: its modules together
    "passes/check.py": "check",
    "passes/buffers.py": "check",  # the lifetime rules the check runs
    "passes/agree.py": "compare",
    "passes/pipeline_check.py": "pipeline",  # not yet behind the language: bench/pipeline_check.py
    "passes/pipeline_gen.py": "pipeline",
}
BEGIN, END = "<!-- codes: generated from schedc.lang.diagnostics.CODES -->", "<!-- end of codes -->"


def stage_text(path: Path) -> str:
    """A stage's source: a module, or every module of a package."""
    if path.is_file():
        return path.read_text()
    return "\n".join(p.read_text() for p in sorted(path.glob("*.py")))


def codes_table() -> str:
    sources: dict[str, str] = {}
    for f, stage in STAGES.items():
        sources[stage] = sources.get(stage, "") + stage_text(REPO / "schedc" / f)
    warnings = {
        c for text in sources.values() for c in re.findall(r'\.warning\(\s*"([\w-]+)"', text)
    }
    rows = ["| code | severity | reported by | meaning |", "|---|---|---|---|"]
    for code, meaning in CODES.items():
        stages = [stage for stage, text in sources.items() if f'"{code}"' in text]
        assert stages, f"no stage reports [{code}]"
        severity = "warning" if code in warnings else "error"
        rows.append(f"| [`{code}`](#{code}) | {severity} | {', '.join(stages)} | {meaning} |")
    return "\n".join(rows)


def test_the_table_lists_every_code():
    doc = DOC.read_text()
    table = codes_table()
    head, _, rest = doc.partition(BEGIN + "\n")
    current, _, tail = rest.partition("\n" + END)
    if REGEN and current != table:
        DOC.write_text(head + BEGIN + "\n" + table + "\n" + END + tail)
        return
    assert current == table, "docs/diagnostics.md is out of date; SCHEDC_REGEN=1 rewrites it"


# -- what the prose names -------------------------------------------------------------------------

TOP = ("schedc/", "tests/", "docs/", "grammar/", "schedules/", "bench/")


def prose(doc: str | None = None) -> str:
    """The document but its shell sessions, which may name files that are not there (an `io`
    example) or that they make."""
    return FENCE.sub(
        lambda m: "" if m.group(1) == "console" else m.group(0), doc or DOC.read_text()
    )


def missing_paths(text: str) -> list[str]:
    paths = set(re.findall(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]*[\w-])", text))
    return sorted(p for p in paths if p.startswith(TOP) and not (REPO / p).exists())


def test_every_path_the_document_names_exists():
    assert missing_paths(prose()) == []
    # the pattern finds paths in prose and in excerpts (this one was in the opening excerpt)
    assert missing_paths("see `schedc/lang/nothing.py`\n```\nschedules/ddp.sched:12:16: error") == [
        "schedc/lang/nothing.py",
        "schedules/ddp.sched",
    ]


def test_every_schedc_name_the_prose_names_exists():
    names = set(re.findall(r"`(schedc(?:\.\w+)+)`", prose()))
    assert "schedc.lang.diagnostics.CODES" in names
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)  # AttributeError names what does not exist
            break
        else:
            pytest.fail(f"{name} is not importable")

"""The compiler's documents say what the compiler does.

docs/language.md: every fenced `sched` block compiles (cleanly), every `sched-error CODE`
block fails with CODE, every `sched-warning CODE` block compiles with that warning, and
together the compiling blocks use every keyword of the grammar. docs/diagnostics.md has a
test of its own (tests/test_docs_diagnostics.py).
"""

from __future__ import annotations

import re

import pytest

from schedc.compiler import compile_text
from schedc.ir.op import Kind, Op
from schedc.lang.diagnostics import CODES, CompileError
from schedc.lang.parse import parser
from tests.goldens import REPO

LANGUAGE = REPO / "docs" / "language.md"

BLOCK = re.compile(
    r"^```(sched(?:-error|-warning)?)(?:[ \t]+([\w-]+))?[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S
)


def blocks() -> list[tuple[str, str | None, str, int]]:
    """(kind, code, text, line) of every sched block in language.md."""
    doc = LANGUAGE.read_text()
    return [
        (m.group(1), m.group(2), m.group(3), doc.count("\n", 0, m.start()) + 1)
        for m in BLOCK.finditer(doc)
    ]


BLOCKS = [
    pytest.param(kind, code, text, id=f"line{line}-{kind}{'-' + code if code else ''}")
    for kind, code, text, line in blocks()
]


@pytest.mark.parametrize("kind, code, text", BLOCKS)
def test_language_example(kind, code, text):
    if kind == "sched":
        assert code is None
        c = compile_text(text, "example.sched")
        assert c.warnings == (), "\n".join(w.render(c.source) for w in c.warnings)
    elif kind == "sched-warning":
        c = compile_text(text, "example.sched")
        assert code in {w.code for w in c.warnings}
    else:
        with pytest.raises(CompileError) as info:
            compile_text(text, "example.sched")
        assert code in info.value.codes, info.value.render()


def test_no_fence_is_misspelled():
    """A block fenced ```sched-eror would silently escape the test above."""
    fences = re.findall(r"^```([\w-]*)", LANGUAGE.read_text(), re.M)
    assert {f for f in fences if f} <= {"sched", "sched-error", "sched-warning"}
    assert len([f for f in fences if f]) == len(BLOCKS)


def test_examples_use_every_keyword_of_the_grammar():
    keywords = {
        t.pattern.value
        for t in parser().terminals
        if t.pattern.type == "str" and t.pattern.value.isidentifier()
    }
    used = set()
    for kind, _code, text, _line in blocks():
        if kind != "sched-error":
            used |= set(re.findall(r"[A-Za-z_]\w*", re.sub(r"#.*", "", text)))
    assert keywords - used == set()


def test_error_examples_name_real_codes():
    assert {code for kind, code, _, _ in blocks() if kind != "sched"} <= set(CODES)


def test_the_op_table_parses():
    section = LANGUAGE.read_text().split("\n## Ops")[1].split("\n## ")[0]
    ops = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert len(ops) == len(Kind)  # every kind of op, once
    for text in ops:
        assert str(Op.parse(text)) == text

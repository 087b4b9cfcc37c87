"""One op vocabulary for every schedule: the package defines one `Kind` and one op type, and
a pipeline program's items are made of the plan's `Op`s."""

from __future__ import annotations

import ast
from pathlib import Path

import schedc
from schedc.ir.op import Kind, Op, stage_op
from schedc.ir.pipeline import format_program, parse_program

PACKAGE = Path(schedc.__file__).parent


def _classes() -> dict[str, list[tuple[str, set[str]]]]:
    """Every class the package defines, by name: the modules that define it, with the names
    its body assigns (an enum's members)."""
    out: dict[str, list[tuple[str, set[str]]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {t.id for a in node.body if isinstance(a, ast.Assign)
                         for t in a.targets if isinstance(t, ast.Name)}  # fmt: skip
                out.setdefault(node.name, []).append((str(path.relative_to(PACKAGE)), names))
    return out


def test_the_package_has_one_kind_and_one_op_type():
    classes = _classes()
    assert [m for m, _ in classes["Kind"]] == ["ir/op.py"]
    assert [m for m, _ in classes["Op"]] == ["ir/op.py"]
    assert [m for m, _ in classes["Action"]] == ["ir/plan.py"]  # a plan's run, record, wait
    # no other enum names what an op does: a forward, a send, a collective
    vocab = {"F", "SEND_F", "ALLREDUCE", "RECOMPUTE", "W"}  # Phase has FWD and BWD
    kinds = [(n, m) for n, defs in classes.items() for m, names in defs if names & vocab]
    assert kinds == [("Kind", "ir/op.py")]


def test_a_pipeline_program_is_made_of_ops():
    text = "F[s0]@mb0 SEND_F[s0]@mb0 SEND_F[s0]@mb1:c1+RECV_B[s0]@mb0 B[s0]@mb0"
    program = parse_program(text)
    assert all(type(op) is Op for item in program for op in item)
    assert program[2] == (stage_op(Kind.SEND_F, 0, 1, "c1"), stage_op(Kind.RECV_B, 0, 0))
    assert format_program(program) == text


def test_a_program_of_the_plan_is_no_pipeline_program():
    try:
        parse_program("F[s0]@mb0 fwd[h.0]@mb0")
    except ValueError as e:
        assert "not a pipeline action: 'fwd[h.0]@mb0'" in str(e)
    else:
        raise AssertionError("a layer's fwd read as a pipeline action")

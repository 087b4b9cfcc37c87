"""The package reads in small pieces: no module over 500 lines, no function over 60 (a
function that is one table literal excepted). ruff's C901 (pyproject.toml) bounds how many
paths a function has; this bounds how much there is to read."""

from __future__ import annotations

import ast

from tests.goldens import REPO

MODULE_LINES = 500
FUNCTION_LINES = 60


def _modules():
    return sorted((REPO / "schedc").rglob("*.py"))


def _is_table(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A function whose body (after its docstring) returns one literal: data, not logic."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    literal = (ast.Dict, ast.List, ast.Tuple, ast.Set)
    return len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, literal)


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_no_function_is_over_60_lines():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_table(node):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {FUNCTION_LINES} lines: {long}"

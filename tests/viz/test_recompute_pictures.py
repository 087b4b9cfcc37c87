"""Recompute ops are drawn in both pictures, in a colour of their own (violet), costed as
their layer's forward, and counted as compute that hides communication."""

from __future__ import annotations

from schedc.analysis.cost import CostModel, duration
from schedc.cli.main import main
from schedc.compiler import compile_text
from schedc.ir.op import Kind, recompute
from schedc.viz.dot import COLORS
from schedc.viz.graph import graph_dot

TEXT = """model nano world 2 batch 8 x 32 micro 2
fsdp { unit tied = wte.weight keep  unit u1 = wpe.weight, h.0  unit u2 = h.1, head  recompute u2 }
"""


def test_recompute_has_a_colour_of_its_own():
    others = {c for k, c in COLORS.items() if k is not Kind.RECOMPUTE}
    assert COLORS[Kind.RECOMPUTE] not in others


def test_the_graph_draws_each_recompute_in_its_colour():
    dot = graph_dot([compile_text(TEXT)], unfold=True)
    fill, stroke = COLORS[Kind.RECOMPUTE]
    lines = [x for x in dot.splitlines() if "recompute[h.1]@mb0" in x and "label=" in x]
    assert lines and fill in lines[0] and stroke in lines[0]


def test_the_timeline_draws_and_costs_recompute_as_a_forward(tmp_path):
    c = compile_text(TEXT)
    cost = CostModel()
    op = recompute("h.1", 0)
    assert duration(c.spec, op, cost) == duration(c.spec, op._replace(kind=Kind.FWD), cost) > 0
    path = tmp_path / "t.sched"
    path.write_text(TEXT)
    out = tmp_path / "t.dot"
    assert main(["render", str(path), "--view", "timeline", "--unfold", "-o", str(out)]) == 0
    text = out.read_text()
    assert "recompute[h.1]@mb1" in text and COLORS[Kind.RECOMPUTE][1] in text

"""schedc render of pipeline schedules: the pipeline grid (schedc/viz/pipeline.py).

The DOT is read back: one box per compute action of every rank, labelled by micro-batch
(and stage when a rank holds several), in program order without overlap; an arrow per
transfer; the idle share of each drawn row equal to the plan's bubble. Goldens in
tests/golden/render/pipeline_*.dot (SCHEDC_REGEN=1 rewrites them).
"""

from __future__ import annotations

import re
import shutil

import pytest

from schedc.cli.main import main
from schedc.compiler import compile_file
from schedc.ir.op import Op
from schedc.lang.resources import pipeline_schedules
from schedc.viz.pipeline import grid_of, pipeline_dot
from schedc.viz.timeline.canvas import WIDTH
from tests.goldens import GOLDEN, REPO, assert_golden

PIPELINES = pipeline_schedules()
IDS = [p.stem for p in PIPELINES]
HAVE_NEATO = shutil.which("neato") is not None
BOX = re.compile(
    r'pos="([-\d.]+),[-\d.]+!", width=([\d.]+), height=[\d.]+, label="([^"]*)".*'
    r'tooltip="rank (\d+): (\S+) ([\d.]+)\.\.([\d.]+)", class="pp_\w"'
)
ARROW = re.compile(r'-> n\d+ \[.*tooltip="(\S+): rank (\d+) -> rank (\d+)", class="pp_transfer"')


def drawn(dot: str) -> dict[int, list[tuple[Op, str, float, float]]]:
    """rank -> (action, label, left x, right x) of each box, in the order drawn."""
    rows: dict[int, list] = {}
    for m in BOX.finditer(dot):
        cx, w = float(m.group(1)), float(m.group(2)) * 72
        rows.setdefault(int(m.group(4)), []).append(
            (Op.parse(m.group(5)), m.group(3), cx - w / 2, cx + w / 2)
        )
    return rows


@pytest.fixture(scope="module", params=PIPELINES, ids=IDS)
def case(request):
    c = compile_file(request.param)
    return request.param, c, pipeline_dot([grid_of(c)])


def test_golden(case):
    path, _, dot = case
    assert_golden(GOLDEN / "render" / f"pipeline_{path.stem}.dot", dot)


def test_one_box_per_compute_action_with_its_label(case):
    _, c, dot = case
    plan = c.pipeline
    rows = drawn(dot)
    assert sorted(rows) == sorted(plan.programs)
    for r, program in plan.programs.items():
        want = [i[0] for i in program if not i[0].kind.is_p2p]
        assert [a for a, *_ in rows[r]] == want  # every one, in program order
        for a, label, *_ in rows[r]:
            name = f"{a.kind.value}{a.mb}"
            assert label == (f"{name}\\ns{a.stage}" if plan.pipeline.per_rank > 1 else name)


def test_boxes_on_a_rank_follow_in_time_without_overlap(case):
    _, _, dot = case
    for row in drawn(dot).values():
        for (_, _, x0, x1), (_, _, n0, _) in zip(row, row[1:]):
            assert x0 < x1 <= n0 + 0.01


def test_every_transfer_has_an_arrow(case):
    _, c, dot = case
    sends = sorted(
        (str(a), r, c.pipeline.pipeline.peer(a))
        for r, p in c.pipeline.programs.items()
        for item in p
        for a in item
        if a.kind.is_send
    )
    arrows = sorted((m.group(1), int(m.group(2)), int(m.group(3))) for m in ARROW.finditer(dot))
    assert arrows == sends and sends


def test_idle_share_of_the_drawn_rows_is_the_plans_bubble(case):
    _, c, dot = case
    plan = c.pipeline
    for r, row in drawn(dot).items():
        busy = sum(x1 - x0 for *_, x0, x1 in row) / WIDTH  # the one grid spans WIDTH
        assert 1 - busy == pytest.approx(plan.bubble[r], abs=1e-3)
        assert f"bubble {100 * plan.bubble[r]:.1f}%" in dot


def test_transfers_go_from_producer_end_to_reader_start(case):
    _, c, _ = case
    g = grid_of(c)
    for t in g.transfers:
        assert t.src.rank != t.dst.rank and t.src.end <= t.dst.start
        assert t.send.mb == t.src.action.mb == t.dst.action.mb


def test_title_says_schedule_stages_microbatches_and_bubble(case):
    _, c, dot = case
    ps, pipe, dp = c.spec.pipeline, c.pipeline.pipeline, c.spec.dp
    ranks = f"{pipe.pp} ranks" if dp == 1 else f"{pipe.pp} pipeline ranks x {dp} replicas"
    assert f"{ps.schedule.value}, {pipe.stages} stages on {ranks}" in dot
    assert f"{pipe.microbatches} micro-batches" in dot
    # a row is a pipeline rank: the ranks that run it (pp-outermost: r x dp + replica)
    assert (
        "bubble rank 0 " if dp == 1 else f"bubble ranks {', '.join(map(str, range(dp)))} "
    ) in dot


def test_several_files_share_one_time_scale():
    a, b = (
        compile_file(REPO / "schedules" / "pipeline" / f)
        for f in ("tiny_pp4_1f1b.sched", "tiny_pp_zb.sched")
    )
    dot = pipeline_dot([grid_of(a), grid_of(b)])
    rows = drawn(dot)  # rank r's boxes of both files, 1f1b's first
    scale = WIDTH / max(a.pipeline.step, b.pipeline.step)
    f0 = next(x for act, _, x0, x1 in rows[0] if (x := x1 - x0) and act.kind.value == "F")
    assert f0 == pytest.approx(scale * a.pipeline.costs.f, abs=0.01)


# -- the CLI --------------------------------------------------------------------------------------


def render(*args: str) -> int:
    return main(["render", *args])


@pytest.mark.parametrize("ext", ["dot", "svg"])
def test_cli_writes_the_grid_by_default(ext, tmp_path, capsys):
    if ext == "svg" and not HAVE_NEATO:
        pytest.skip("Graphviz's neato is not installed")
    out = tmp_path / f"pp.{ext}"
    assert render(str(REPO / "schedules" / "pipeline" / "tiny_pp4_1f1b.sched"), "-o", str(out)) == 0
    said = capsys.readouterr().out
    assert f"wrote {out} (pipeline timeline)" in said and "bubble rank 0" in said
    text = out.read_text()
    assert "</svg>" in text if ext == "svg" else 'class="pp_transfer"' in text


def test_cli_view_timeline_and_several_files(tmp_path):
    out = tmp_path / "pp.dot"
    assert render(*map(str, PIPELINES), "--view", "timeline", "-o", str(out)) == 0
    assert out.read_text().count("stages on") == len(PIPELINES)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--view", "graph"], "--view graph: "),
        (["--window", "mb1:"], "--window: "),
        (["--unfold"], "--unfold: "),
        (["--rank", "0"], "--rank: "),
        (["--flops", "300T"], "--flops: "),
        (["--latency", "10us"], "--latency: "),
    ],
)
def test_cli_refuses_what_the_grid_does_not_draw(flags, said, tmp_path, capsys):
    assert render(str(PIPELINES[0]), *flags, "-o", str(tmp_path / "x.dot")) == 1
    err = capsys.readouterr().err.strip()
    assert said in err and "pipeline schedule" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.dot").exists()


def test_cli_refuses_a_pipeline_beside_a_data_parallel_schedule(tmp_path, capsys):
    dp = REPO / "schedules" / "ddp_overlap.sched"
    for files in ([PIPELINES[0], dp], [dp, PIPELINES[0]]):
        assert render(*map(str, files), "-o", str(tmp_path / "x.dot")) == 1
        err = capsys.readouterr().err.strip()
        assert "render them apart" in err and len(err.splitlines()) == 1

"""Pipeline stages in .sched: the bundled pipeline schedules check clean with the textbook
bubble, their programs print and parse back, they agree with one process on the batch, the
verbs that need a DP plan refuse them in one line, and broken copies fail by code.

The bundled pipeline schedules live in schedules/pipeline/, out of `bundled_schedules()`:
the DP suites that lower, draw and run every bundled schedule have no pipeline graph,
plan or executor to take them yet (lang/resources.py).
"""

from __future__ import annotations

import pytest

from schedc.cli.main import main
from schedc.compiler import compile_file, compile_text
from schedc.ir.pipeline import parse_program
from schedc.lang.diagnostics import CompileError
from schedc.lang.resources import bundled_schedules, pipeline_schedules
from schedc.passes.agree import compare
from tests.goldens import REPO
from tests.pipeline_ranks import ONE_PROCESS

PIPELINE = REPO / "schedules" / "pipeline"


def test_the_pipeline_bundle():
    assert [p.name for p in pipeline_schedules()] == [
        "tiny_pp2_dp2.sched",
        "tiny_pp2_dp2_ddp.sched",
        "tiny_pp2_dp2_fsdp.sched",
        "tiny_pp2_hsdp.sched",
        "tiny_pp2_interleaved.sched",
        "tiny_pp2_written.sched",
        "tiny_pp2_zbv.sched",
        "tiny_pp4_1f1b.sched",
        "tiny_pp_zb.sched",
    ]
    assert not set(pipeline_schedules()) & set(bundled_schedules())


# (file, schedule, ranks, stages, micro-batches, bubble on every rank): the textbook bubble
# at F = 1, B = 2 (I = W = 1): 1F1B (p-1)/(m+p-1), ZB-H1 (p-1)/(3m+p-1), interleaved
# (p-1)/(vm+p-1) = 1/9 as the executor waits (under blocking rendezvous it is 22.6%), ZB-V
# (p-1)/(6m+p-1) at I = W = F a stage, two stages a rank (tests/passes/test_pipeline.py)
BUBBLES = [
    ("tiny_pp4_1f1b.sched", "1f1b", 4, 4, 8, 3 / 11),
    ("tiny_pp_zb.sched", "zb-h1", 4, 4, 8, 3 / 27),
    ("tiny_pp2_interleaved.sched", "interleaved-1f1b", 2, 4, 4, 1 / 9),
    ("tiny_pp2_zbv.sched", "zb-v", 2, 4, 4, 1 / 25),
]


@pytest.mark.parametrize("name, schedule, pp, stages, m, bubble", BUBBLES)
def test_bundled_pipeline_proves_with_its_bubble(name, schedule, pp, stages, m, bubble):
    c = compile_file(PIPELINE / name)
    ps, plan = c.spec.pipeline, c.pipeline
    assert ps is not None and plan is not None and c.warnings == ()
    assert (ps.schedule.value, ps.degree, len(ps.stages), c.spec.accum) == (
        schedule,
        pp,
        stages,
        m,
    )
    assert c.spec.dp == 1 and c.spec.micro * c.spec.accum == c.spec.seqs
    assert sorted(plan.bubble) == list(range(pp))
    assert all(b == pytest.approx(bubble, abs=1e-4) for b in plan.bubble.values())
    layers = [layer for st in ps.stages for layer in st.layers]
    assert layers == list(c.spec.model.layers)  # every layer once, in order


def test_the_programs_print_side_by_side_and_parse_back():
    c = compile_file(PIPELINE / "tiny_pp4_1f1b.sched")
    assert c.pipeline is not None
    for line, (rank, prog) in zip(c.pipeline.rank_lines(), sorted(c.pipeline.programs.items())):
        head, text = line.split(": ", 1)
        assert head == f"rank {rank}" and parse_program(text) == prog
    dump = c.dump("pipeline")
    assert dump.splitlines()[0].split() == ["rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    assert "SEND_F[s0]@mb0" in dump and "RECV_B[s0]@mb7" in dump


def test_a_pipeline_agrees_with_one_process_on_the_batch():
    """dp = world / degree = 1: every sequence read once at weight 1/(micro T) / m."""
    one = compile_file(REPO / "schedules" / "tiny_1gpu.sched").spec
    for name in ("tiny_pp4_1f1b.sched", "tiny_pp_zb.sched"):
        pp = compile_file(PIPELINE / name).spec
        assert pp.loss_weight() == one.loss_weight()
        assert compare(one, pp).agree, compare(one, pp).diagnostics


def test_dp_x_pp_agrees_with_one_process_and_prints_its_layout(capsys):
    """world 4 = degree 2 x dp 2: each replica reads its own half of the batch, and `schedc
    check` says so, with the global ranks of each stage pp-outermost."""
    c = compile_file(PIPELINE / "tiny_pp2_dp2.sched")
    assert c.spec.pipeline is not None and c.spec.pipeline.degree == 2
    assert (c.spec.world, c.spec.dp, c.spec.micro, c.spec.accum) == (4, 2, 2, 2)
    one = compile_text(ONE_PROCESS, "one.sched").spec
    assert compare(one, c.spec).agree, compare(one, c.spec).diagnostics
    assert main(["check", str(PIPELINE / "tiny_pp2_dp2.sched")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  pipeline "))
    assert "2 stages, 1f1b, placement loop, 2 micro-batches, dp 2 (rank = pp x 2 + replica" in line
    assert "    s0     ranks 0, 1  embed" in out and "    s1     ranks 2, 3  h.2" in out


def test_check_prints_the_pipeline_line(capsys):
    assert main(["check", str(PIPELINE / "tiny_pp4_1f1b.sched")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  pipeline "))
    assert "4 stages, 1f1b, placement loop, 8 micro-batches" in line
    assert "bubble per rank 27.3% 27.3% 27.3% 27.3%" in line
    assert "    s3     rank 3  h.3, head" in out


def test_check_dumps_a_pipeline_ranks_bound_plan(capsys):
    """`--dump plan --rank g`: global rank g's plan as the proof read it and its executor
    runs it (passes/pipeline_bind.py), in the one op vocabulary."""
    path = str(PIPELINE / "tiny_pp2_hsdp.sched")
    assert main(["check", "--dump", "plan", "--rank", "5", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# plan for rank 5: ")
    ops = [line.split()[-1] for line in lines[1:]]
    assert ops[:3] == ["RECV_F[s1]@mb0", "allgather[tied]@mb0:fwd", "allgather[s1.a]@mb0:fwd"]
    assert "reducescatter[s1.a]@mb1" in ops and ops[-2:] == [
        "allreduce[wte.weight]@mb1",
        "optimizer.step",
    ]


def test_a_pipeline_has_no_dependency_graph_yet_and_says_so_in_one_line(capsys):
    path = str(PIPELINE / "tiny_pp4_1f1b.sched")
    assert main(["check", "--dump", "graph", path]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "is a pipeline schedule: a dependency graph of pipeline stages is not built yet" in err


@pytest.mark.parametrize(
    "name, argv, said",
    [
        ("tiny_pp2_hsdp", ["--save", "ck"], "--save (of HSDP per stage)"),
        ("tiny_pp2_hsdp", ["--resume", "ck"], "--resume (of HSDP per stage)"),
        ("tiny_pp4_1f1b", ["--probe", "--trace", "t.json"], "--probe"),
        ("tiny_pp4_1f1b", ["--compile", "on"], "`compile` and `loss chunk`"),
        ("tiny_pp4_1f1b", ["--val-every", "5"], None),  # refused by the compiler: val needs shards
    ],
)
def test_run_refuses_what_a_pipeline_run_does_not_do_yet(capsys, tmp_path, name, argv, said):
    """Before torch is imported, one line: nothing asked of a pipeline run is dropped."""
    path = str(PIPELINE / f"{name}.sched")
    assert main(["run", path, *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    if said:
        assert err.count("\n") == 0, err
        assert f"is a pipeline schedule, whose runs do not take {said} yet" in err


def test_a_dp_schedule_has_no_pipeline_to_dump(capsys):
    assert main(["check", "--dump", "pipeline", str(REPO / "schedules" / "tiny_1gpu.sched")]) == 1
    assert "has no pipeline block to dump" in capsys.readouterr().err


# -- broken copies of the bundled files, one rule each ----------------------------------------

# tiny_pp2_hsdp's fsdp block, from its first line to the end of the file
FSDP_BLOCK = (PIPELINE / "tiny_pp2_hsdp.sched").read_text().partition("\nfsdp {")[1:]
FSDP_BLOCK = FSDP_BLOCK[0] + FSDP_BLOCK[1]

MUTATIONS = {
    "tiny_pp4_1f1b.sched": [
        ("stage s2 = h.2\n", "", "uncovered"),
        ("stage s1 = h.1", "stage s1 = h.1 .. h.2", "double-cover"),
        ("micro 2", "micro 8", "pp-microbatches"),  # 2 micro-batches on 4 stages
        ("schedule 1f1b", "schedule gpipe\n  microbatches 3", "batch-arithmetic"),  # 2 x 3 != 16
        ("stage s3 = h.3, head", "stage s3 = h.3\n  stage s4 = head", "stage-count"),
    ],
    "tiny_pp2_dp2.sched": [
        ("  degree 2", "  degree 3", "mesh-size"),  # 3 does not divide world 4
        ("microbatches 2", "microbatches 3", "batch-arithmetic"),  # 8 != 3 x dp 2 x micro
        ("world 4\n", "world 4\nddp { bucket_cap 1 MiB }\n", "conflict"),
        ("world 4\n", "world 4\nfsdp { unit all = embed .. head }\n", "conflict"),  # tied + more
    ],
    "tiny_pp2_dp2_ddp.sched": [
        ("bucket s1.a = h.2", "bucket s1.a = h.2 .. h.1", "double-cover"),
        ("bucket s0.a = embed", "bucket s0.a = wpe.weight", "uncovered"),
        ("bucket s1.a = h.2", "bucket s1.a = h.2\n  bucket_cap 1 MiB", "conflict"),
        ("world 4\n", "world 4\nfsdp { }\n", "conflict"),  # both blocks
    ],
    "tiny_pp2_dp2_fsdp.sched": [
        ("unit s1.a = h.2 .. h.3, head", "unit s1.a = h.3, head", "uncovered"),
        ("reshard_after_forward off", "reshard_after_forward on", "conflict"),
        ("reshard_after_forward off", "prefetch forward 2", "conflict"),
        ("unit tied = wte.weight ", "unit tied = wte.weight, wpe.weight ", "double-cover"),
        ("  degree 2\n", "  degree 3\n", "mesh-size"),
    ],
    "tiny_pp2_hsdp.sched": [
        ("mesh 2 x 2", "mesh 2 x 4", "mesh-size"),  # 8 ranks, but dp is 4
        ("mesh 2 x 2", "mesh 3 x 1", "mesh-size"),
        ("fsdp {", "ddp { }\nfsdp {", "conflict"),  # both blocks
        (FSDP_BLOCK, "", "mesh-ddp"),  # DDP per stage shards nothing
    ],
    "tiny_pp2_interleaved.sched": [
        ("microbatches 4", "microbatches 3", "batch-arithmetic"),
        ("placement loop", "placement v", "conflict"),
        ("stage s1 = h.1\n  stage s2 = h.2", "stage s1 = h.2\n  stage s2 = h.1", "stage-order"),
    ],
    "tiny_pp2_written.sched": [
        ("microbatches 4", "schedule 1f1b\n  microbatches 4", "conflict"),
        ("B[s1]@mb3  SEND_B[s1]@mb3", "SEND_B[s1]@mb3  B[s1]@mb3", "pp-order"),
        ("SEND_B[s1]@mb3\n", "SEND_B[s1]@mb3:c1\n", "pp-unmatched"),
    ],
    "tiny_pp_zb.sched": [
        ("batch 16 x 64", "batch 4 x 64", "pp-microbatches"),
        ("world 4", "world 4\nddp { bucket_cap 1 MiB }", "conflict"),
        ("zb-h1", "zb-h2", "unknown-name"),
    ],
    "tiny_pp2_zbv.sched": [
        ("placement v", "placement loop", "conflict"),  # zb-v runs a V
        ("  placement v\n", "", "conflict"),  # nor the default loop
        ("stage s3 = h.3, head", "stage s3 = h.3\n  stage s4 = head", "stage-count"),
        ("schedule zb-v", "schedule zb-h1", "stage-count"),  # one stage a rank
        ("microbatches 4", "microbatches 3", "batch-arithmetic"),
    ],
}


def test_every_pipeline_file_has_mutations():
    assert set(MUTATIONS) == {p.name for p in pipeline_schedules()}


@pytest.mark.parametrize(
    "name, old, new, code",
    [(n, *m) for n, ms in MUTATIONS.items() for m in ms],
    ids=lambda v: v if isinstance(v, str) and v.endswith(".sched") else None,
)
def test_a_broken_pipeline_fails_by_code(name, old, new, code):
    text = (PIPELINE / name).read_text()
    assert old in text
    with pytest.raises(CompileError) as info:
        compile_text(text.replace(old, new, 1), name)
    assert set(info.value.codes) == {code}, info.value.render()


# -- FSDP per stage -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edits, message, underlined",
    [
        (
            [("wpe.weight, h.0 .. h.1", "wpe.weight, h.0 .. h.2"), ("a = h.2 .. h.3", "a = h.3")],
            "unit 's0.a' spans stages 's0' and 's1'",
            "unit s0.a = wpe.weight, h.0 .. h.2",
        ),
        (
            [("wte.weight ", "wte.weight, wpe.weight "), ("= wpe.weight, h.0", "= h.0")],
            "unit 'tied' holds wte.weight with other parameters",
            "unit tied = wte.weight, wpe.weight",
        ),
        (
            [("reshard_after_forward off", "no_sync on")],
            "a pipeline's fsdp block cannot take no_sync",
            "no_sync",
        ),
    ],
)
def test_a_pipelines_fsdp_units_lie_inside_stages(edits, message, underlined):
    """Each unit is inside one stage, the tied weight alone in its unit, and what an fsdp
    block says about gathering within a step is refused, each located."""
    text = (PIPELINE / "tiny_pp2_dp2_fsdp.sched").read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new, 1)
    with pytest.raises(CompileError) as info:
        compile_text(text, "f.sched")
    (d,) = info.value.diagnostics
    assert d.code == "conflict" and message in d.message
    assert text[d.span.start : d.span.end].strip() == underlined


def test_an_fsdp_block_with_no_units_shards_each_stage_as_one():
    text = (PIPELINE / "tiny_pp2_dp2_fsdp.sched").read_text()
    block = text[text.index("fsdp {") :]
    c = compile_text(text.replace(block, "fsdp { }\n"), "f.sched")
    assert c.spec.pipeline is not None
    units = [(u.name, u.stage, u.params[:1]) for u in c.spec.pipeline.units]
    assert units == [
        ("tied", 0, ("wte.weight",)),
        ("s0", 0, ("wpe.weight",)),
        ("s1", 1, ("h.2.ln_1.weight",)),
    ]
    written = compile_file(PIPELINE / "tiny_pp2_dp2_fsdp.sched").spec.pipeline
    assert written is not None
    assert [u.params for u in written.units] == [u.params for u in c.spec.pipeline.units]


# -- DDP per stage --------------------------------------------------------------------------


def test_a_pipelines_ddp_buckets_lie_inside_stages():
    """A bucket across two stages is refused where it is written, naming both stages."""
    text = (PIPELINE / "tiny_pp2_dp2_ddp.sched").read_text()
    text = text.replace("bucket s1.a = h.2", "bucket s1.a = h.2 .. h.1").replace(
        "s0.b = h.1 .. h.0", "s0.b = h.0"
    )
    with pytest.raises(CompileError) as info:
        compile_text(text, "f.sched")
    (d,) = info.value.diagnostics
    assert d.code == "conflict" and "bucket 's1.a' spans stages 's0' and 's1'" in d.message
    assert (d.span.line, d.span.col) == (25, 3)
    assert [n.message for n in d.notes] == ["stage 's0'", "stage 's1'"]
    assert info.value.render().count("f.sched:25:3") == 1


def test_a_ddp_block_with_no_buckets_is_one_a_stage(capsys):
    text = (PIPELINE / "tiny_pp2_dp2_ddp.sched").read_text()
    block = text[text.index("ddp {") :]
    c = compile_text(text.replace(block, "ddp { overlap on  no_sync on }\n"), "f.sched")
    assert c.spec.pipeline is not None and c.spec.sync.value == "ddp"
    assert [(b.name, b.stage, len(b.params)) for b in c.spec.pipeline.buckets] == [
        ("s0", 0, 2 + 2 * 12),
        ("s1", 1, 2 * 12 + 2),
    ]
    assert main(["check", str(PIPELINE / "tiny_pp2_dp2_ddp.sched")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  pipeline "))
    assert "in 4 buckets, each stage's in reverse layer order: s1.b in s1, s1.a in s1," in line

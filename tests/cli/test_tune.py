"""`schedc tune`: the table and its counts, -o and --write-top files that check and draw,
a budget nothing fits, flag errors, GPT-2 124M at world 8, and --measure on real ranks."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from schedc.analysis.cost import CostModel
from schedc.analysis.simulate import simulate
from schedc.cli.main import EXIT_USER, main
from schedc.compiler import compile_file
from schedc.passes.agree import compare
from schedc.tune.measure import GRACE_S, run_bounded
from schedc.tune.search import Options, search
from schedc.tune.space import Base
from tests.goldens import REPO

FSDP = "schedules/tiny_fsdp_prefetch.sched"
NANO = """\
model nano
world 2
batch 8 x 32
steps 3
data corpus
optimizer adamw { lr = 1e-3 }
ddp { bucket_cap 1 MiB }
"""


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(REPO)


def tune(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["tune", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("#   "))
    table = []
    for ln in lines[start + 1 :]:
        if not re.match(r"\s*\d+\s", ln):
            break
        table.append(re.split(r"\s{2,}", ln.strip()))  # columns are 2+ spaces apart
    return table


def test_the_table_ranks_by_predicted_step_and_says_what_was_searched(capsys):
    code, out, err = tune(capsys, FSDP, "--top", "4")
    assert code == 0, err
    counts = re.search(r"([\d,]+) considered:.*compiled \((.+?) refused by the checker", out)
    assert counts and int(counts[1].replace(",", "")) > 100
    table = rows(out)
    assert [r[0] for r in table] == ["1", "2", "3", "4"]
    res = search(Base.read(FSDP), Options(budget=64 << 20, top=4))  # the file's memory
    assert [c.knobs.describe() for c in res.ranked] == [r[8] for r in table]
    steps = [c.step for c in res.ranked]
    assert steps == sorted(steps)


def test_the_written_schedule_checks_and_is_the_candidate(capsys, tmp_path):
    out_file = tmp_path / "best.sched"
    code, out, err = tune(capsys, FSDP, "-o", str(out_file))
    assert code == 0, err
    text = out_file.read_text()
    assert text.startswith("# Written by `schedc tune")
    assert main(["check", str(out_file)]) == 0
    written = compile_file(out_file)
    best = search(Base.read(FSDP), Options(budget=64 << 20, top=1)).ranked[0]
    assert written.plan().instrs == best.compiled.plan().instrs
    assert simulate(written).end == pytest.approx(best.step)
    assert written.spec.memory == 64 << 20  # the budget is the written schedule's `memory`


def test_the_top_files_check_and_render_side_by_side(capsys, tmp_path):
    top = tmp_path / "top"
    code, out, _ = tune(capsys, FSDP, "--top", "3", "--write-top", str(top))
    assert code == 0
    files = [str(top / f"{i}.sched") for i in (1, 2, 3)]
    assert f"schedc render {' '.join(files)} --view timeline" in out
    for f in files:
        assert main(["check", f]) == 0
    dot = tmp_path / "top.dot"
    assert main(["render", *files, "--view", "timeline", "-o", str(dot)]) == 0
    assert dot.read_text().count("step") >= 3


def test_a_budget_nothing_fits_names_the_smallest_predicted_peak(capsys):
    code, out, err = tune(capsys, FSDP, "--budget", "1MiB")
    assert code == EXIT_USER
    assert "Traceback" not in err
    m = re.search(
        r"error: .*: no schedule fits the budget of 1\.00 MiB per rank; the smallest "
        r"predicted peak is ([\d.]+) MiB",
        err,
    )
    assert m, err
    res = search(Base.read(FSDP), Options(budget=1 << 20))
    least = res.smallest_peak
    assert float(m[1]) == pytest.approx((least.peak) / (1 << 20), abs=0.01)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budget", "lots"], "--budget 'lots': expected a size"),
        (["--precision", "fp8"], "known policies are fp32, bf16"),
        (["--strategy", "zero"], "expected ddp, fsdp"),
        (["--top", "2", "--measure", "3"], "at most --top"),
        (["--rounds", "3"], "--rounds 3 repeats the measured runs: it needs --measure"),
        (["--steps", "3"], "--steps 3 sets the steps of each measured run: it needs --measure"),
    ],
)
def test_bad_flags_are_user_errors(capsys, args, message):
    code, _, err = tune(capsys, FSDP, *args)
    assert code == EXIT_USER and message in err and "Traceback" not in err


def test_gpt2_124m_at_world_8_says_what_it_considered_and_refused(capsys):
    code, out, err = tune(capsys, "schedules/gpt2_8gpu.sched", "--budget", "80GiB")
    assert code == 0, err
    m = re.search(r"([\d,]+) considered:.*compiled \((.+?) refused by the checker", out)
    assert m and int(m[1].replace(",", "")) > 1000
    table = rows(out)
    assert table and all(
        r[3].endswith(" GiB") and float(r[3].split()[0]) <= 80 for r in table
    )  # peak+act in GiB


@pytest.mark.torch
@pytest.mark.ranks
def test_measure_runs_the_finalists_and_refits_the_cost_model(capsys, tmp_path):
    src = tmp_path / "nano.sched"
    src.write_text(NANO)
    fit = tmp_path / "fit.json"
    code, out, err = tune(
        capsys,
        str(src),
        "--top",
        "2",
        "--measure",
        "2",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--strategy",
        "ddp",
        "--fit",
        str(fit),
        "--write-top",
        str(tmp_path / "top"),
    )
    assert code == 0, err
    assert "predicted vs measured" in out and "the median of 2 interleaved rounds" in out
    # round 1 runs both candidates before round 2 runs either, which starts one later
    lines = [x for x in out.splitlines() if x.startswith("schedc: measuring")]
    assert [x.split(":")[1] for x in lines] == [
        " measuring 1/2, round 1/2",
        " measuring 2/2, round 1/2",
        " measuring 2/2, round 2/2",
        " measuring 1/2, round 2/2",
    ]
    assert re.search(r"median \|error\| [\d.]+% over 2 measured", out)
    assert re.search(r"the pick is -?[\d.]+% slower", out)
    if not re.search(r"the fastest measured \(#1\)", out):  # the pick itself was fastest
        assert re.search(r"paired by round, the pick took [\d.]+-[\d.]+x the fastest", out)
    # the traces it took fit a cost model that loads like calibrate's
    cost = CostModel.load(fit)
    assert cost.flops_tf32 != CostModel().flops_tf32
    assert json.loads(fit.read_text())["bandwidth"] > 0
    assert (tmp_path / "top" / "1.r2.trace.json").exists()


def test_a_searched_precision_replaces_the_files(capsys, tmp_path):
    src = tmp_path / "bf16.sched"
    src.write_text(NANO + "precision bf16\n")
    best = tmp_path / "best.sched"
    code, out, err = tune(capsys, str(src), "--precision", "fp32,bf16", "-o", str(best))
    assert code == 0, err
    assert "0 refused by the checker" in out
    assert best.read_text().count("precision ") == 1
    assert main(["check", str(best)]) == 0


def test_the_winner_keeps_the_files_numerics(capsys, tmp_path):
    """gpt2_8gpu's `precision bf16` is DDP's: bf16 autocast on the fp32 weights. An FSDP
    winner would read it as bf16 gathers too, other arithmetic: tune writes the file's own
    numerics out for it instead, and `check` of the two files finds the same numerics."""
    best = tmp_path / "best.sched"
    code, out, err = tune(capsys, "schedules/gpt2_8gpu.sched", "--budget", "80GiB", "-o", str(best))
    assert code == 0, err
    text = best.read_text()
    if "fsdp {" in text:
        assert "precision { compute = bf16  gather = fp32  reduce = fp32 }" in text
        assert "# Numerics: the input's, written out for fsdp" in text
    a, b = (compile_file(p).spec for p in ("schedules/gpt2_8gpu.sched", best))
    verdict = compare(a, b)
    assert verdict.agree and verdict.numerics == (), verdict


def test_a_strategy_that_cannot_keep_the_numerics_is_left_out_and_said(capsys, tmp_path):
    """An FSDP file that gathers in bf16 has no DDP twin (DDP gathers nothing): its DDP
    candidates are counted and said, not ranked, unless --precision searches the policy."""
    src = tmp_path / "fsdp_bf16.sched"
    src.write_text(NANO.replace("ddp { bucket_cap 1 MiB }", "fsdp { unit all = embed .. head }"))
    src.write_text(src.read_text() + "precision bf16\n")
    code, out, err = tune(capsys, str(src))
    assert code == 0, err
    assert re.search(r"considered: [\d,]+ ddp that cannot keep the file's numerics", out), out
    assert "schedc: note: ddp cannot compute what" in out
    assert "no ddp schedule fits" not in out
    assert all(r[-1].startswith("fsdp") for r in rows(out))
    code, out, err = tune(capsys, str(src), "--precision", "bf16")  # searched: both strategies
    assert code == 0 and "cannot keep" not in out, (out, err)


def test_a_long_search_says_how_far_it_is(capsys, monkeypatch):
    monkeypatch.setattr("schedc.tune.search.PROGRESS_S", 0.0)
    code, out, err = tune(capsys, FSDP, "--top", "2")
    assert code == 0, err
    assert re.search(r"schedc: tune: [\d,]+ of [\d,]+ candidates by bound, [\d,]+ compiled", out)


def test_a_measured_run_past_its_timeout_is_ended_as_ctrl_c_would(tmp_path):
    """SIGTERM first (a launcher ends its ranks on it; a SIGKILLed one could not), then
    SIGKILL only if it is still there after the grace."""
    told = tmp_path / "told"
    script = (
        "import signal, sys, time\n"
        f"def term(*_): open({str(told)!r}, 'w').write('SIGTERM'); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    assert run_bounded([sys.executable, "-c", script], dict(os.environ), 2.0) is None
    assert time.monotonic() - t0 < 2.0 + GRACE_S
    assert told.read_text() == "SIGTERM"
    assert run_bounded([sys.executable, "-c", "print('ok')"], dict(os.environ), 30) == (0, "ok\n")

"""`schedc check`: exit codes, the summary, each --dump, and comparing two schedules.

0: every schedule is legal. 1: a user error (diagnostics, no traceback). 2: a bug in
schedc (a traceback under "internal error"). Most tests call `schedc.cli.main` in-process;
a few run `python -m schedc` to see what a shell sees.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import schedc.compiler
from schedc.cli.main import EXIT_INTERNAL, EXIT_USER, main
from tests.goldens import REPO

TINY = "schedules/tiny_ddp_overlap.sched"
FSDP = "schedules/tiny_fsdp_prefetch.sched"


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(REPO)


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- exit codes ----------------------------------------------------------------------------------


def test_a_legal_schedule_exits_0_with_a_summary(capsys):
    code, out, err = check(capsys, TINY)
    assert code == 0 and err == ""
    assert re.sub(r", [\d.]+ ms\)$", ", N ms)", out, flags=re.M).splitlines() == [
        f"{TINY}: ok",
        "  model     tiny: 1,334,016 params (4 layers, 4 heads, C=128, context 128, vocab 4096)",
        "  batch     16 x 64 = 1,024 tokens per update",
        "  split     world 2 x micro 2 x 4 micro-steps (no_sync: only the last communicates)",
        "  strategy  DDP, 2 buckets (explicit buckets), overlap on",
        "    b1        1.51 MiB  head .. h.2",
        "    b2        3.58 MiB  h.1 .. embed",
        "  streams   ops: compute 49, comm 2; 3 events",
        "  numerics  compute fp32, reduce fp32; master weights and AdamW fp32; tf32 auto (on "
        "CUDA), compile off",
        "  memory    per rank: model states 20.36 MiB, activations (peak) 10.21 MiB, "
        "total (peak) 30.57 MiB",
        "  proof     every update reads 16 sequences once at 1/1,024 per token; replicas "
        "equal (abstract execution of 2 plans, N ms)",
    ]


@pytest.mark.parametrize(
    "file,dtypes",
    [
        (FSDP, "compute bf16, gather bf16, reduce fp32"),
        (TINY, "compute bf16, reduce fp32"),  # DDP gathers nothing
        ("schedules/tiny_1gpu.sched", "compute bf16"),  # one process reduces nothing
    ],
)
def test_the_summary_claims_only_the_dtypes_a_strategy_uses(capsys, file, dtypes):
    code, out, _ = check(capsys, file, "--precision", "bf16", "--compile", "on")
    assert code == 0
    assert (
        f"  numerics  {dtypes}; master weights and AdamW fp32; tf32 auto (on CUDA), "
        "compile on\n" in out
    )


def _strategy_line(capsys, tmp_path, text: str) -> list[str]:
    """The summary's strategy line and the lines under it, for a schedule written here."""
    path = tmp_path / "s.sched"
    path.write_text(text)
    code, out, err = check(capsys, str(path))
    assert code == 0, err
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("  strategy  "))
    return lines[i:]


TINY_DDP = "model tiny world 2 batch 8 x 64 micro 2\n"


@pytest.mark.parametrize(
    "extra, says",
    [
        ("ddp { bucket_cap 1 MiB }", "overlap on"),
        ("ddp { bucket_cap 1 MiB  overlap off }", "overlap off"),
        (  # `overlap` is on (the default), but no all-reduce can overlap anything
            "ddp { bucket_cap 1 MiB }\nstream allreduce = compute",
            "no overlap: `stream allreduce = compute` puts every all-reduce on compute",
        ),
        ("ddp { bucket_cap 1 MiB }\nstream allreduce = ar", "overlap on"),  # a stream of its own
    ],
)
def test_the_summary_says_where_all_reduce_runs_not_what_overlap_reads(
    capsys, tmp_path, extra, says
):
    line = _strategy_line(capsys, tmp_path, TINY_DDP + extra)[0]
    assert line.endswith(f"), {says}"), line


def test_the_summary_says_when_fsdp_collectives_run_on_compute(capsys, tmp_path):
    text = (REPO / FSDP).read_text()
    assert "no overlap" not in _strategy_line(capsys, tmp_path, text)[0]
    line = _strategy_line(capsys, tmp_path, text + "stream allgather = compute\n")[0]
    assert line.endswith("; all-gather on the compute stream (no overlap)"), line


def test_bucket_cap_first_makes_the_first_bucket_and_the_summary_shows_it(capsys, tmp_path):
    plain = _strategy_line(capsys, tmp_path, TINY_DDP + "ddp { bucket_cap 1 MiB }")
    first = _strategy_line(capsys, tmp_path, TINY_DDP + "ddp { bucket_cap 1 MiB first 256 KiB }")
    assert "(bucket_cap 1.00 MiB, first 1.00 MiB)" in plain[0]  # the default: min(cap, 1 MiB)
    assert "(bucket_cap 1.00 MiB, first 256.00 KiB)" in first[0]
    # the first bucket closes at 256 KiB (passing it by its last parameter), not at 1 MiB
    assert first[1].split()[:3] == ["b1", "257.50", "KiB"], first[1]
    assert plain[1].split()[:3] == ["b1", "1.01", "MiB"], plain[1]


@pytest.mark.parametrize(
    "text",
    [
        "model nano { n_layer = 1  n_head = 1 } world 1 batch 1 x 1 micro 1\n"
        "ddp { bucket b1 = embed .. head }",
        "model nano { n_layer = 1  n_head = 1 } world 2 batch 2 x 1 micro 1\n"
        "fsdp { unit all = embed .. head }",
    ],
    ids=["ddp", "fsdp"],
)
def test_the_summary_counts_in_the_singular(capsys, tmp_path, text):
    path = tmp_path / "one.sched"
    path.write_text(text)
    code, out, _ = check(capsys, str(path))
    assert code == 0
    assert "(1 layer, 1 head," in out and "x 1 micro-step\n" in out
    assert ", 1 bucket (" in out or ", 1 unit," in out
    # no "1 buckets", "1 units", ...; a measured time such as the proof's "2.1 ms" is not one
    assert not re.search(r"(?<![\d.])1 [a-z-]+s\b", out), out
    for dump in ("graph", "plan"):
        code, out, _ = check(capsys, str(path), "--dump", dump)
        assert not re.search(r"\b1 [a-z-]+s\b", out.splitlines()[0]), out.splitlines()[0]


def test_no_files_checks_every_bundled_schedule(capsys):
    code, out, _ = check(capsys)
    assert code == 0
    files = [*(REPO / "schedules").glob("*.sched"), *(REPO / "schedules/pipeline").glob("*.sched")]
    assert out.count(": ok\n") == len(files)  # the pipeline schedules too


def test_a_user_error_exits_1_without_a_traceback(capsys, tmp_path):
    bad = tmp_path / "bad.sched"
    bad.write_text("model tiny\nworld 2\nbatch 16 x 64\nmicro 3\nddp { bucket_cap 1 MiB }\n")
    code, out, err = check(capsys, str(bad))
    assert code == EXIT_USER == 1 and out == ""
    assert err.splitlines() == [
        f"{bad}:4:1: error: global batch 16 is not micro 3 x world 2 x a whole number of "
        "micro-steps  [batch-arithmetic]",
        "  4 | micro 3",
        "    | ^~~~~~~",
        "  hint: for example micro 1 (k=8), micro 2 (k=4), micro 4 (k=2), micro 8 (k=1)",
        "1 error",
    ]


def test_errors_in_several_files_are_all_reported(capsys, tmp_path):
    a, b = tmp_path / "a.sched", tmp_path / "b.sched"
    a.write_text("modle tiny\n")
    b.write_text("model tiny\nworld 0\nbatch 16 x 64\nmicro 2\nseed -1\n")
    code, _, err = check(capsys, str(a), TINY, str(b))
    assert code == 1
    assert f"{a}:1:1: error: unexpected 'modle'  [syntax]" in err
    assert f"{b}:2:7: error: world must be >= 1, got 0  [value-range]" in err
    assert f"{b}:5:6: error: seed must be >= 0, got -1  [value-range]" in err
    assert err.rstrip().endswith("2 errors")  # the count of the last file's errors


def test_an_internal_error_exits_2_with_a_traceback(capsys, monkeypatch):
    def broken(graph):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(schedc.compiler, "lower", broken)
    code, _, err = check(capsys, TINY)
    assert code == EXIT_INTERNAL == 2
    assert err.startswith("schedc: internal error (a bug in schedc; please report it")
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: lowering exploded" in err


def test_usage_errors_exit_1(capsys):
    code, _, err = check(capsys, TINY, FSDP, "--dump", "plan")
    assert code == 1 and err == "schedc: error: --dump takes one file\n"
    with pytest.raises(SystemExit) as info:  # argparse's own usage errors exit 1 too
        main(["check", TINY, "--dump", "dot"])
    assert info.value.code == 1
    assert "invalid choice: 'dot'" in capsys.readouterr().err


def test_warnings_go_to_stderr_and_still_exit_0(capsys, tmp_path):
    f = tmp_path / "late.sched"
    f.write_text(
        "model nano\nworld 2\nbatch 8 x 32\nmicro 2\n"
        "ddp { bucket b1 = embed, h.0  bucket b2 = head, h.1 }\n"
    )
    code, out, err = check(capsys, str(f))
    assert code == 0 and f"{f}: ok" in out
    assert f"{f}:5:7: warning: bucket 'b1' holds wte.weight" in err and "[tied-late]" in err


def test_flags_override_the_file(capsys):
    code, out, _ = check(capsys, "schedules/tiny_4gpu.sched", "--model", "nano")
    assert code == 0 and "  model     nano: " in out
    code, _, err = check(capsys, TINY, "--model", "nano")  # its buckets name h.3: no such layer
    assert code == 1 and "error: the model has no layer h.3  [layer-range]" in err
    code, _, err = check(capsys, TINY, "--model", "gpt3")
    assert code == 1
    assert "schedc: --model gpt3: error: unknown model 'gpt3'  [unknown-model]" in err
    assert "hint: did you mean 'gpt2'?" in err


# -- --dump ---------------------------------------------------------------------------------------


def test_dump_ast(capsys):
    code, out, _ = check(capsys, TINY, "--dump", "ast")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "Model @4:1"
    assert "Setting(key='world', value=Num(text='2', span=Span(start=" not in out  # spans elided
    assert "  name: Name(text='tiny') @4:7" in lines
    assert any(line.startswith("DDP @") for line in lines)
    assert "first: Name(text='head') @14:15" in out


def test_dump_graph(capsys):
    code, out, _ = check(capsys, TINY, "--dump", "graph")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("# graph: 51 ops, 2 streams, ")
    i = lines.index("comm     allreduce[b1]@mb3")
    assert lines[i + 1 : i + 4] == [
        "           needs bwd[head]@mb3 (complete gradients)",
        "           needs bwd[h.3]@mb3 (complete gradients)",
        "           needs bwd[h.2]@mb3 (complete gradients)  <- event",
    ]


def test_dump_program(capsys):
    code, out, _ = check(capsys, TINY, "--dump", "program")
    assert code == 0
    assert out.endswith(
        "program comm {\n  allreduce[b1]@mb3 after bwd[h.2]@mb3\n"
        "  allreduce[b2]@mb3 after bwd[embed]@mb3\n}\n"
    )
    assert "  optimizer.step after allreduce[b2]@mb3\n}\n" in out


def test_dump_plan(capsys):
    code, out, _ = check(capsys, FSDP, "--dump", "plan")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == (
        "# plan for every rank: 59 ops on 2 streams (compute, comm), 26 events and the step start"
    )
    assert lines[1:6] == [
        "    0  record compute  e26    # step start",
        "    1  wait   comm     e26    # for step start",
        "    2  run    comm     allgather[tied]@mb0:fwd",
        "    3  run    comm     allgather[u1]@mb0:fwd",
        "    4  record comm     e0    # after allgather[u1]@mb0:fwd",
    ]


def test_dump_of_one_rank(capsys, tmp_path):
    f = tmp_path / "ranks.sched"
    f.write_text(
        (REPO / TINY).read_text() + "program comm on rank 1 {\n"
        "  allreduce[b1]@mb3 after bwd[h.2]@mb3\n"
        "  allreduce[b2]@mb3 after bwd[embed]@mb3\n}\n"
    )
    _, every, _ = check(capsys, str(f), "--dump", "plan")
    _, one, _ = check(capsys, str(f), "--dump", "plan", "--rank", "1")
    assert every.startswith("# plan for every rank:") and one.startswith("# plan for rank 1:")
    assert every.splitlines()[1:] == one.splitlines()[1:]  # rank 1 wrote what it would run


# -- two files ------------------------------------------------------------------------------------


def test_two_schedules_that_agree(capsys):
    code, out, err = check(capsys, "schedules/tiny_1gpu.sched", "schedules/tiny_4gpu.sched")
    assert code == 0 and err == ""
    assert out.endswith(
        "\nschedules/tiny_1gpu.sched: 1,024 tokens per update\n"
        "schedules/tiny_4gpu.sched: 1,024 tokens per update\n"
        "agree: same model, same 16 sequences each read once, every token weighted 1/1024 in "
        "the loss (1/k x 1/D x micro mean), same optimizer, same numerics: the same update\n"
    )


def test_two_schedules_that_agree_on_the_batch_but_not_the_numerics(capsys, tmp_path):
    """Exit 0 (the batch and its weights agree), but no claim of "the same update"."""
    other = tmp_path / "bf16.sched"
    other.write_text((REPO / "schedules/tiny_4gpu.sched").read_text() + "precision bf16\n")
    code, out, err = check(capsys, "schedules/tiny_1gpu.sched", str(other))
    assert code == 0 and err == ""
    assert "  numerics  compute bf16, reduce fp32; master weights and AdamW fp32" in out
    last = out.splitlines()[-1]
    assert last.startswith("agree on the batch: same model, same 16 sequences each read once")
    assert last.endswith(
        "same optimizer: the same update in exact arithmetic; numerics differ: compute fp32 "
        f"vs bf16 (schedules/tiny_1gpu.sched vs {other}), so the updates differ by rounding"
    )
    assert "the same update\n" not in out


def test_two_schedules_that_disagree(capsys, tmp_path):
    other = tmp_path / "other.sched"
    other.write_text(
        (REPO / "schedules/tiny_4gpu.sched")
        .read_text()
        .replace("batch 16 x 64", "batch 32 x 64")
        .replace("lr = 3e-3", "lr = 1e-3")
    )
    code, out, err = check(capsys, "schedules/tiny_1gpu.sched", str(other))
    assert code == 1
    assert f"{other}: 2,048 tokens per update" in out
    assert (
        f"{other}:4:1: error: the global batches differ: 32 x 64 here, 16 x 64 in "
        "schedules/tiny_1gpu.sched  [disagree]" in err
    )
    assert "note: schedules/tiny_1gpu.sched has 16 x 64" in err
    assert "error: the optimizers differ in lr: lr=0.001 here, lr=0.003 in" in err
    assert err.rstrip().endswith("2 errors")


# -- what a shell sees ----------------------------------------------------------------------------


def test_python_m_schedc():
    r = subprocess.run(
        [sys.executable, "-m", "schedc", "check", TINY, "--dump", "program"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.startswith("program compute {\n")
    r = subprocess.run(
        [sys.executable, "-m", "schedc", "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.startswith("schedc ")


def test_check_does_not_import_torch():
    """The compiler runs anywhere: checking a schedule needs no torch."""
    code = (
        "import sys; from schedc.cli.main import main; rc = main(['check', "
        f"'{TINY}', '--dump', 'plan']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr

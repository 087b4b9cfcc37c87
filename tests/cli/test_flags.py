"""Every command-line value is judged like the file's, and ranks agree on meaning (issue 14).

A flag that overrides the file (--steps, --seed, --model) goes through the file's own rules
and gets the file's diagnostic code, placed at `schedc: --FLAG VALUE`; a pure run flag
(--timeout, --save-every, --keep, output paths) is a usage error; both exit 1, never with a
traceback. At start-up ranks compare the schedule's meaning and the run flags, and refuse
to start, on every rank, naming the field and the ranks that differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schedc.cli.main import main
from schedc.compiler import compile_text
from schedc.lang.diagnostics import CompileError
from schedc.passes.agree import meaning
from tests.goldens import REPO
from tests.ranks import finish, free_port, start_ranks

SCHEDULES = REPO / "schedules"
DDP = str(SCHEDULES / "tiny_ddp_overlap.sched")
ONE = str(SCHEDULES / "tiny_1gpu.sched")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`schedc ARGV` in this process: (exit code, stdout, stderr), usage errors included."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    return code, out, err


# -- flags that override the file: the file's rules and codes -------------------------------------


@pytest.mark.parametrize(
    "argv,want",
    [
        (["--steps", "-5"], "schedc: --steps -5: error: steps must be >= 1, got -5  [value-range]"),
        (["--steps", "0"], "schedc: --steps 0: error: steps must be >= 1, got 0  [value-range]"),
        (["--seed", "-1"], "schedc: --seed -1: error: seed must be >= 0, got -1  [value-range]"),
        (["--seed", "9" * 30], "error: seed must be <= 9,223,372,036,854,775,807, got 999"),
        (["--model", "gpt3"], "schedc: --model gpt3: error: unknown model 'gpt3'  [unknown-model]"),
        (
            ["--dump", "plan", "--rank", "99"],
            "schedc: --rank 99: error: rank must be <= 1, got 99  [value-range]",
        ),
        (
            ["--dump", "plan", "--rank", "-1"],
            "schedc: --rank -1: error: rank must be >= 0, got -1  [value-range]",
        ),
    ],
)
def test_check_flags_get_the_files_diagnostics(capsys, argv, want):
    code, _, err = cli(capsys, "check", DDP, *argv)
    assert code == 1 and want in err, err
    assert err.rstrip().endswith("1 error")
    if "--rank" in argv:
        assert "is a world-2 schedule: ranks 0 .. 1" in err  # names the world


def test_a_flag_and_the_file_say_the_same_thing(capsys, tmp_path):
    """One rule: `steps 0` in the file and `--steps 0` give the same message and code."""
    f = tmp_path / "s.sched"
    f.write_text(Path(ONE).read_text().replace("steps 40", "steps 0"))
    _, _, from_file = cli(capsys, "check", str(f))
    _, _, from_flag = cli(capsys, "check", ONE, "--steps", "0")
    msg = "error: steps must be >= 1, got 0  [value-range]"
    assert f"{f}:7:7: {msg}" in from_file and f"schedc: --steps 0: {msg}" in from_flag


def test_a_bad_flag_is_said_once_not_once_per_bundled_schedule(capsys):
    code, _, err = cli(capsys, "check", "--seed", "-1")
    assert code == 1 and err.count("seed must be >= 0") == 1


@pytest.mark.parametrize(
    "argv,want",
    [
        (
            ["--sample-every", "5"],
            "schedc: --sample-every 5: error: samples decode GPT-2 token ids (tiktoken's gpt2: "
            "50,257), and the model's vocabulary holds 4,096  [conflict]",
        ),
        (
            ["--hellaswag", "h.jsonl"],
            "schedc: --hellaswag h.jsonl: error: HellaSwag scores GPT-2 token ids",
        ),
        (
            ["--hellaswag-every", "3"],
            "schedc: --hellaswag-every 3: error: hellaswag_every scores nothing without a "
            "`hellaswag` file  [missing-setting]",
        ),
    ],
)
def test_evaluation_flags_get_the_files_diagnostics(capsys, argv, want):
    """`run --sample-every` and `--hellaswag` on tiny (vocabulary 4096) are judged by the
    `eval` block's rules, at the flag, before torch starts."""
    code, out, err = cli(capsys, "run", ONE, *argv)
    assert code == 1 and want in err, err
    assert out == ""


def test_run_flag_overrides_are_refused_before_torch_starts(capsys):
    code, out, err = cli(capsys, "run", ONE, "--steps", "-5")
    assert code == 1 and "schedc: --steps -5: error: steps must be >= 1" in err
    assert out == ""  # nothing trained: `--steps -5` used to train nothing and exit 0


# -- run flags: usage errors, paths checked before any work ---------------------------------------


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--timeout", "-5", "must be between 0.001 and 1e+06, got -5"),
        ("--timeout", "nan", "must be between 0.001 and 1e+06, got nan"),
        ("--timeout", "inf", "must be between 0.001 and 1e+06, got inf"),
        ("--timeout", "0", "must be between 0.001 and 1e+06, got 0"),
        ("--timeout", "soon", "'soon' is not a number of seconds"),
        ("--save-every", "0", "must be at least 1, got 0"),
        ("--save-every", "-1", "must be at least 1, got -1"),
        ("--keep", "-1", "must be at least 0, got -1"),
    ],
)
def test_bad_run_flag_values_are_usage_errors(capsys, flag, value, want):
    code, out, err = cli(capsys, "run", ONE, flag, value)
    assert code == 1 and f"schedc run: error: argument {flag}: {want}" in err, err
    assert err.startswith("usage: schedc run") and out == ""


def test_usage_errors_exit_1_not_argparses_2(capsys):
    assert cli(capsys, "check", "--dump", "dot")[0] == 1
    assert cli(capsys, "nosuchverb")[0] == 1


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--trace", "/missing/dir/t.json", "no such directory: /missing/dir"),
        ("--trace", "{tmp}", "is a directory, not a file"),
        ("--log-json", "/missing/dir/log.jsonl", "no such directory: /missing/dir"),
        ("--log-json", "{tmp}", "is a directory, not a file"),
        ("--save", "/missing/dir/ck", "no such directory: /missing/dir"),
        ("--save", "{tmp}/file", "not a directory"),
        ("--save", "{tmp}/file/ck", "not a directory: "),
        ("--save", "/proc/ck", "cannot write"),
        ("--trace", "/proc/t.json", "cannot write"),
        ("--trace", "{tmp}/" + "t" * 300, "the file name is 300 bytes, more than the 255"),
        ("--log-json", "{tmp}/" + "l" * 300, "more than the 255 its file system allows"),
        ("--tensorboard", "/missing/dir/tb", "no such directory: /missing/dir"),
        ("--tensorboard", "{tmp}/file", "not a directory"),
    ],
)
def test_output_paths_are_refused_before_training(capsys, tmp_path, flag, value, want):
    (tmp_path / "file").write_text("x")
    value = value.format(tmp=tmp_path)
    code, out, err = cli(capsys, "run", ONE, "--steps", "1", flag, value)
    assert code == 1 and f"schedc: error: {flag} {value[:60]}" in err and want in err, err
    assert "step" not in out  # refused before step 0, not after the run as --trace was


@pytest.mark.parametrize(
    "argv",
    [
        ["run", ONE, "--trace", ""],
        ["run", ONE, "--save", ""],
        ["run", ONE, "--resume", ""],
        ["run", ONE, "--log-json", " "],
        ["run", ONE, "--tensorboard", ""],
        ["run", ONE, "--hellaswag", " "],
        ["render", ONE, "-o", ""],
        ["tune", ONE, "--budget", ""],
        ["tune", ONE, "-o", ""],
    ],
    ids=lambda a: " ".join(a[2:]) or "empty",
)
def test_an_empty_flag_value_is_refused_not_ignored(capsys, argv):
    code, out, err = cli(capsys, *argv)
    assert code == 1 and "schedc: error:" in err and "Traceback" not in err, err
    assert out == "" or "step" not in out


@pytest.mark.parametrize(
    "argv,want",
    [
        (["check", DDP, "--rank", "1"], "--rank 1 picks the rank whose graph, program or plan"),
        (["run", ONE, "--keep", "0"], "--keep 0 says how many checkpoints --save keeps"),
        (["run", ONE, "--save-every", "5"], "--save-every 5 says how often --save writes"),
        (["run", ONE, "--probe"], "--probe times collectives and layers for the trace"),
        (["tune", ONE, "--timeout", "30"], "--timeout 30 bounds each measured run"),
        (["tune", ONE, "--measure", "0", "--steps", "2"], "it needs --measure"),
        (["render", DDP, "-o", "{tmp}/g.dot", "--latency", "5us"], "the graph view does not"),
        (
            ["render", DDP, "-o", "{tmp}/g.dot", "--trace", "{tmp}/t.json", "--cost", "p.json"],
            "a measured one without --compare does not draw: add --compare",
        ),
    ],
)
def test_a_flag_that_would_do_nothing_is_refused(capsys, tmp_path, argv, want):
    """A flag whose effect needs another flag is refused alone, not silently ignored."""
    code, out, err = cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 1 and "schedc: error: " in err and want in err, err
    assert "step" not in out


@pytest.mark.parametrize(
    "argv,want",
    [
        (["run", "{s}", "--log-json", "{s}"], "--log-json {s}: that is the schedule"),
        (["run", "{s}", "--trace", "{s}"], "--trace {s}: that is the schedule"),
        (
            ["run", "{s}", "--hellaswag", "{t}", "--log-json", "{t}"],
            "--log-json {t}: that is --hellaswag, which this command reads",
        ),
        (["tune", "{s}", "-o", "{s}"], "-o {s}: that is the schedule, which this command reads"),
        (["render", "{s}", "-o", "{t}", "--view", "timeline", "--cost", "{t}"], "that is --cost"),
        (["calibrate", "{t}", "-o", "{t}"], "-o {t}: that is the trace"),
    ],
)
def test_an_output_never_writes_over_an_input(capsys, tmp_path, argv, want):
    s, t = tmp_path / "s.sched", tmp_path / "t.dot"
    s.write_text(Path(ONE).read_text())
    t.write_text("{}")
    argv = [a.format(s=s, t=t) for a in argv]
    code, _, err = cli(capsys, *argv)
    assert code == 1 and want.format(s=s, t=t) in err, err
    assert s.read_text() == Path(ONE).read_text() and t.read_text() == "{}"


def test_two_outputs_of_one_run_must_differ(capsys, tmp_path):
    x = str(tmp_path / "x")
    code, _, err = cli(capsys, "tune", ONE, "-o", x, "--write-top", x)
    assert code == 1 and f"--write-top {x}: -o writes there too" in err, err
    code, _, err = cli(capsys, "run", ONE, "--trace", x, "--log-json", x)
    assert code == 1 and f"--log-json {x}: --trace writes there too" in err, err


def test_ranks_checking_one_missing_output_at_once_never_collide(tmp_path):
    """Every rank checks --trace's path at start-up, at the same moment: the check probes a
    name of its own, never the path itself, so none sees another's probe (the old check
    created and removed the path: 'File exists' for the loser, seen in tune --measure)."""
    import threading

    from schedc.cli.common import check_output

    path, errors = str(tmp_path / "t.json"), []
    start = threading.Barrier(8)

    def rank() -> None:
        for _ in range(200):
            try:
                start.wait()
                check_output("--trace", path)
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and not Path(path).exists()
    assert not list(tmp_path.iterdir())  # no probe left behind


# -- optimizer values that fp32 turns into zero ---------------------------------------------------

BASE = Path(ONE).read_text().replace("optimizer adamw { lr = 3e-3  min_lr = 3e-4  warmup = 5 }", "")


@pytest.mark.parametrize(
    "setting,want",
    [
        ("eps = 1e-50", "eps = 1e-50 is 0 in fp32, and AdamW divides by sqrt(v) + eps"),
        ("eps = 0", "eps = 0 is 0 in fp32"),
        ("eps = 1e-40", "a subnormal (0 on a GPU)"),
        ("lr = 1e-50", "lr = 1e-50 is 0 in fp32, so no update would change the model"),
        ("clip = 1e-46", "clip = 1e-46 is 0 in fp32, so clipping would scale every gradient"),
    ],
)
def test_optimizer_values_that_round_to_zero_are_refused(setting, want):
    with pytest.raises(CompileError) as e:
        compile_text(BASE + f"optimizer adamw {{ {setting} }}\n", "o.sched")
    assert e.value.codes == ["value-range"] and want in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "setting", ["eps = 1e-8", "eps = 1e-30", "clip = 0", "weight_decay = 1e-50", "min_lr = 0"]
)
def test_optimizer_values_fp32_holds_are_accepted(setting):
    compile_text(BASE + f"optimizer adamw {{ {setting} }}\n", "o.sched")


@pytest.mark.torch  # shows the NaN with torch.optim.AdamW itself
def test_eps_that_rounds_to_zero_makes_adamw_nan():
    """Why the rule exists: a parameter with no gradient (m = v = 0) becomes 0/0."""
    import torch

    for eps, nan in ((1e-50, True), (1e-8, False)):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([p], lr=1e-3, eps=eps)
        p.grad = torch.zeros(3)
        opt.step()
        assert bool(p.detach().isnan().all()) is nan


# -- agreement on meaning -------------------------------------------------------------------------

SPELLINGS = [
    ("data corpus\n", ""),
    ('data "f.txt"\n', 'data text "f.txt"\n'),
    ('data "f.bin"\n', 'data tokens "f.bin"\n'),
]


@pytest.mark.parametrize("a,b", SPELLINGS)
def test_check_agrees_on_data_spelled_differently(capsys, tmp_path, a, b):
    text = Path(DDP).read_text().replace("data corpus\n", "")
    fa, fb = tmp_path / "a.sched", tmp_path / "b.sched"
    fa.write_text(text + a)
    fb.write_text("# the same run, spelled another way\n" + text + b)
    code, out, err = cli(capsys, "check", str(fa), str(fb))
    assert code == 0 and "agree: same model" in out, err
    assert meaning(compile_text(fa.read_text()).spec) == meaning(compile_text(fb.read_text()).spec)


def test_data_that_really_differs_is_named_without_contradiction(capsys, tmp_path):
    text = Path(DDP).read_text().replace("data corpus\n", "")
    fa, fb = tmp_path / "a.sched", tmp_path / "b.sched"
    fa.write_text(text + 'data text "f.bin"\n')
    fb.write_text(text + 'data "f.bin"\n')  # auto: .bin is tokens
    code, _, err = cli(capsys, "check", str(fa), str(fb))
    assert code == 1
    assert 'the data sources differ: tokens "f.bin" here, text "f.bin" in' in err, err


def test_shard_lists_in_another_order_differ(capsys, tmp_path):
    """The order of the shards is the order of the token stream: `check a b` says so."""
    text = Path(DDP).read_text().replace("data corpus\n", "")
    fa, fb = tmp_path / "a.sched", tmp_path / "b.sched"
    fa.write_text(text + 'data "s/x_train_1.npy", "s/x_train_2.npy"\n')
    fb.write_text(text + 'data "s/x_train_2.npy", "s/x_train_1.npy"\n')
    code, _, err = cli(capsys, "check", str(fa), str(fb))
    assert code == 1
    assert (
        'the data sources differ: tokens "s/x_train_2.npy", "s/x_train_1.npy" here, '
        'tokens "s/x_train_1.npy", "s/x_train_2.npy" in'
    ) in err, err


def test_meaning_names_what_differs():
    text = Path(DDP).read_text()
    a = meaning(compile_text(text).spec)
    b = meaning(compile_text(text.replace("seed 1337", "seed 7")).spec)
    assert {k for k in a if a[k] != b[k]} == {"seed"}


def test_meaning_covers_every_field_of_the_spec_even_one_added_later():
    """The compared set is derived from Spec's fields: a setting added to Spec is compared
    without being listed anywhere (here a subclass with one more field)."""
    import dataclasses

    from schedc.ir.spec import Spec
    from schedc.passes.agree import NAMED, NOT_MEANING

    spec = compile_text(Path(DDP).read_text()).spec
    covered = set(NAMED) | set(NOT_MEANING) | {k.split(".")[0] for k in meaning(spec)}
    assert {f.name for f in dataclasses.fields(Spec)} <= covered

    @dataclasses.dataclass(frozen=True)
    class Wider(Spec):
        new_setting: int = 0

    base = {f.name: getattr(spec, f.name) for f in dataclasses.fields(Spec)}
    a, b = Wider(**base, new_setting=1), Wider(**base, new_setting=2)
    ma, mb = meaning(a), meaning(b)
    assert {k for k in ma if ma[k] != mb[k]} == {"new_setting"}


@pytest.mark.parametrize(
    "edit, field",
    [
        ("precision { compute = bf16 }\n", "numerics.compute"),
        ("precision { reduce = bf16 }\n", "numerics.reduce"),
        ("tf32 off\n", "numerics.tf32"),
        ("compile on\n", "numerics.compile"),
        ("loss chunk 16\n", "numerics.loss_chunk"),
        ("recompute h.0\n", "recompute"),
    ],
)
def test_meaning_names_each_numerics_setting(edit, field):
    text = Path(DDP).read_text()
    a, b = meaning(compile_text(text).spec), meaning(compile_text(text + edit).spec)
    assert {k for k in a if a[k] != b[k]} == {field}


# -- start-up agreement across ranks (real processes, gloo) ---------------------------------------


def launch(per_rank: list[list[str]]) -> list[tuple[int, str, str]]:
    """`schedc run ARGS[r]` as one process per rank, as torchrun starts them (torchrun
    gives every rank the same args, here each its own); (exit code, stdout, stderr) of each."""
    return finish(start_ranks(per_rank), timeout=180)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("ck") / "ck"
    (code, _, err), _ = launch([[DDP, "--steps", "1", "--save", str(ck), "--save-every", "1"]] * 2)
    assert code == 0, err
    return ck


@pytest.mark.torch
@pytest.mark.ranks
@pytest.mark.parametrize("case", ["seed", "resume", "save"])
def test_ranks_with_different_flags_refuse_to_start(case, tmp_path, request):
    common = [DDP, "--steps", "2", "--timeout", "60"]
    if case == "seed":
        per_rank = [common + ["--seed", "1"], common + ["--seed", "2"]]
        want = "seed 1 on rank 0, 2 on rank 1"
    elif case == "resume":
        ck = request.getfixturevalue("checkpoint")
        per_rank = [common + ["--resume", str(ck)], common]
        want = f"--resume {ck.resolve()}/step_00000001 (step 1) on rank 0, none on rank 1"
    else:
        per_rank = [common, common + ["--save", str(tmp_path / "ck")]]
        want = f"--save none on rank 0, {tmp_path / 'ck'} every 100, keep 2 on rank 1"
    for code, out, err in launch(per_rank):
        assert code == 1, err
        assert "ranks disagree before step 1" in err and want in err, err
        assert "step    0" not in out and "Traceback" not in err
    assert not (tmp_path / "ck").exists()


@pytest.mark.torch
@pytest.mark.ranks
def test_ranks_with_the_same_meaning_spelled_differently_run_together(tmp_path):
    """Rank 1's file has comments and no `data corpus` line: once a text hash, now equal."""
    other = tmp_path / "other.sched"
    other.write_text(
        "# spelled differently\n"
        + Path(DDP).read_text().replace("data corpus\n", "")
        + "# the end\n"
    )
    (c0, out, e0), (c1, _, e1) = launch([[DDP, "--steps", "1"], [str(other), "--steps", "1"]])
    assert c0 == 0 and c1 == 0, e0 + e1
    assert "step    0" in out


# -- ranks that differ in numerics, recompute, mesh or tracing ------------------------------------

FSDP2 = """model nano
world 2
batch 4 x 16
micro 2
steps 1
fsdp { unit all = embed .. head }
"""
DDP2 = FSDP2.replace("fsdp { unit all = embed .. head }", "ddp { bucket_cap 1 MiB }")
# case -> (the schedule, what rank 1 adds to it: text, flags as Overrides, or a trace,
# the field every rank must name); rank 0 runs the schedule as it is
DIFFER = {
    "precision": (DDP2, {"precision": "bf16"}, "numerics.compute"),
    "compute": (DDP2, "precision { compute = bf16 }\n", "numerics.compute"),
    "gather": (FSDP2, "precision bf16\n", "numerics.gather"),  # gather bf16 needs compute bf16
    "reduce": (DDP2, "precision { reduce = bf16 }\n", "numerics.reduce"),
    "tf32": (DDP2, {"tf32": False}, "numerics.tf32"),
    "compile": (DDP2, {"compile": True}, "numerics.compile"),
    "loss chunk": (DDP2, "loss chunk 16\n", "numerics.loss_chunk"),
    "recompute": (DDP2, "recompute h.0\n", "recompute"),
    "mesh": (FSDP2, "mesh 2 x 1\n", "declared_mesh"),
    "trace": (DDP2, {"trace": "t.json"}, "--trace"),
}


def _agree_on_ranks(rank, world, q) -> None:
    """Each case's start-up agreement, as `schedc run` makes it (exec/train.py: the meaning
    of the schedule after the flags, the collectives, the data, the run flags), on two
    real gloo ranks; every rank reports what it refused with."""
    import datetime
    import traceback

    try:
        import torch.distributed as dist

        from schedc.errors import RunError
        from schedc.exec.options import Comm, RunOptions
        from schedc.exec.train import TrainOptions, agree_at_startup, run_flags
        from schedc.lang.resolve import Overrides
        from schedc.model.data import corpus_tokens, fingerprint

        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        out = {}
        for case, (text, change, _) in DIFFER.items():
            flags = change if rank == 1 and isinstance(change, dict) else {}
            if rank == 1 and isinstance(change, str):
                text += change
            trace = flags.pop("trace", None)
            compiled = compile_text(text, f"{case}.sched", Overrides(**flags))
            job = TrainOptions(trace=trace)
            opts = RunOptions(device="cpu", trace=bool(trace))
            try:
                agree_at_startup(
                    compiled,
                    Comm(rank, world, None, timeout),
                    compiled.plan(rank),
                    fingerprint(corpus_tokens()),
                    run_flags(job, __import__("torch").device("cpu"), opts),
                )
                out[case] = "agreed"
            except RunError as e:
                out[case] = str(e)
        q.put((rank, out))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def differing(tmp_path_factory) -> dict[int, dict[str, str]]:
    from tests.cuda_ranks import spawn_ranks

    with pytest.MonkeyPatch.context() as env:  # read by the ranks' env:// rendezvous
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(free_port()))
        return spawn_ranks(_agree_on_ranks, 2, (), timeout=180)


@pytest.mark.torch
@pytest.mark.ranks
@pytest.mark.parametrize("case", DIFFER)
def test_ranks_differing_in_numerics_mesh_or_trace_refuse_to_start(differing, case):
    """Refused before step 0 on every rank, the field named (a difference in numerics once
    trained silently, or aborted inside gloo)."""
    field = DIFFER[case][2]
    for rank in (0, 1):
        said = differing[rank][case]
        assert said.startswith("ranks disagree before step 1") and f"{field} " in said, said


@pytest.mark.torch
@pytest.mark.ranks
@pytest.mark.parametrize("flags", [["--precision", "bf16"], ["--trace", "TRACE"]])
def test_a_numerics_or_trace_flag_on_one_rank_refuses_the_job(tmp_path, flags):
    """The same through the command line, as torchrun starts it: every rank exits 1 before
    step 0, naming the field (no gloo abort, no rank waiting out --timeout)."""
    flags = [f.replace("TRACE", str(tmp_path / "t.json")) for f in flags]
    field = "numerics.compute" if "--precision" in flags else "--trace"
    common = [DDP, "--steps", "1", "--timeout", "60"]
    for code, out, err in launch([common, common + flags]):
        assert code == 1, err
        assert "ranks disagree before step 1" in err and f"{field} " in err, err
        assert "step    0" not in out and "Traceback" not in err

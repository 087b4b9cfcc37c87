"""The commands README.md and docs/*.md show in ```sh blocks run, exit 0 (issue 19).

Every line of every ```sh (bash, shell, console) block is a case: the quick `schedc check`,
`schedc render`, `schedc calibrate` and world-1 `python -m schedc run` commands are run
(render writes into a temporary directory instead of docs/render/, so the committed pictures
stay as they are; `run` gets `--steps 2`, which overrides the file's steps); every other
line is skipped with the reason printed, so a new command is either run or explained.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from schedc.cli.main import main
from tests.goldens import REPO
from tests.ranks import python

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(?:sh|bash|shell|console)\n(.*?)```", re.S)

# Why a line is not run here: the first prefix that matches.
SKIP = [
    (
        "make ",
        "installs and runs the whole suite or the demo (tests/exec/test_run.py runs the demo's command)",
    ),
    ("torchrun ", "multi-rank (tests/exec/test_run.py and tests/cli/test_run_log.py run torchrun)"),
    ("python -m torch.distributed.run", "multi-rank: writes the trace the next commands read"),
    ("python -m pytest", "the test suite itself"),
    ("scripts/", "builds a fresh venv: minutes"),
    ("ruff ", "lint (make test and CI run it)"),
    ("python bench/", "a benchmark: minutes"),
    ("head -c", "makes a key file, not a schedc command"),
]


def commands() -> list[tuple[str, str]]:
    """(where, command) for every command line of every sh block: continuations joined,
    a `$ ` prompt and a trailing `# comment` removed."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line_no = text[: m.start()].count("\n") + 2
            joined = m.group(1).replace("\\\n", " ")
            for k, line in enumerate(joined.splitlines()):
                cmd = re.sub(r"\s+#\s.*$", "", line.strip()).removeprefix("$ ").strip()
                if cmd and not cmd.startswith("#"):
                    out.append((f"{doc.relative_to(REPO)}:{line_no + k}", cmd))
    return out


def classify(cmd: str) -> str | None:
    """None: run it; else why not."""
    bare = re.sub(r"^([A-Z_]+=\S*\s+)+", "", cmd)  # VAR=value prefixes
    for prefix, why in SKIP:
        if bare.startswith(prefix):
            return why
    argv = shlex.split(bare)
    if argv[:1] == ["schedc"]:
        args = argv[1:]
    elif argv[:3] == ["python", "-m", "schedc"]:
        args = argv[3:]
    else:
        return "not a schedc command"
    if any(a.startswith("[") or a in ("FILE.sched", "RUN.json") for a in args):
        return "a synopsis, not a command"
    if missing := [a for a in args if a.endswith(".sched") and not (REPO / a).is_file()]:
        return f"{missing[0]} is the text's own example, not a file in the repository"
    flags = OUTPUT_FLAGS | ({"--trace"} if args[:1] == ["run"] else set())  # render reads it
    outputs = {b for a, b in zip(args, args[1:]) if a in flags}
    inputs = [a for a in args if a.startswith("out/") and a not in outputs]
    if missing := [a for a in inputs if not (REPO / a).exists()]:
        return f"reads {missing[0]}, which a command above it writes (a torchrun run)"
    if "--measure" in args:
        return "--measure runs the candidates on their ranks: minutes"
    if args[:1] == ["run"]:
        return _run_skip(args)
    return None


def _run_skip(args: list[str]) -> str | None:
    """Why a documented `schedc run` is not run here (each runs 2 steps in a process of its
    own, its ranks started by itself): a model that takes hours a step on a CPU, or data a
    script makes first."""
    from schedc.compiler import compile_file
    from schedc.lang.resources import default_schedule

    sched = next((a for a in args[1:] if a.endswith(".sched")), None)
    spec = compile_file(str(REPO / sched) if sched else str(default_schedule())).spec
    if spec.model.numel > 20_000_000:
        return f"trains a model of {spec.model.numel:,} parameters: hours on a CPU"
    if spec.data.source.startswith("out/"):
        return f"reads {spec.data.source}, which scripts/make_shards.py makes (test_recipe.py)"
    return None


OUTPUT_FLAGS = {"-o", "--output", "--write-top", "--fit", "--save"}


CASES = commands()


def test_the_docs_show_commands_of_every_verb():
    """The extraction finds what the README shows (so an empty list cannot pass)."""
    runnable = [c for _, c in CASES if classify(c) is None]
    for verb in ("check", "render", "run"):
        assert any(re.match(rf"(python -m )?schedc {verb}\b", c) for c in runnable), verb


WRITES = OUTPUT_FLAGS | {"--trace", "--log-json", "--tensorboard"}


def test_no_documented_command_writes_into_the_checkout_s_tracked_files():
    """A reader who runs the docs' commands leaves the checkout as it was (#29 stumble 8:
    README wrote t.json and best.sched into its root): what a command writes goes under
    out/ (ignored), into docs/ (the commands that redraw or refit what the docs show), a
    folder the command names for itself, or a placeholder in capitals."""
    seen = 0
    for where, cmd in CASES:
        try:
            argv = shlex.split(cmd)
        except ValueError:
            continue
        for flag, path in zip(argv, argv[1:]):
            if flag not in WRITES:
                continue
            seen += 1
            ok = (
                path.startswith(("out/", "docs/", "<dir>/"))
                or path.split("/")[0].split(".")[0].isupper()
            )
            assert ok, f"{where}: {cmd} writes {path} into the checkout"
    assert seen > 10


def outputs_to(argv: list[str], tmp: Path) -> list[str]:
    """-o PATH -> -o tmp/NAME: the docs' pictures are drawn, not overwritten; and what a run
    writes (its trace, log, checkpoints) goes there too, not into an out/ a fresh clone has
    not made."""
    out = list(argv)
    run = "run" in out[:4]
    for i, a in enumerate(out[:-1]):
        if a in ("-o", "--output") or (run and a in RUN_WRITES):
            out[i + 1] = str(tmp / Path(out[i + 1]).name)
    return out


RUN_WRITES = {"--trace", "--log-json", "--save", "--tensorboard"}


@pytest.mark.parametrize(
    "where,cmd",
    [
        pytest.param(w, c, id=w, marks=[pytest.mark.torch] if " run " in f"{c} " else [])
        for w, c in CASES
    ],
)
def test_a_documented_command_runs(where, cmd, tmp_path, monkeypatch, capsys):
    why = classify(cmd)
    if why:
        pytest.skip(why)
    argv = outputs_to(shlex.split(cmd), tmp_path)
    monkeypatch.chdir(REPO)
    if argv[0] == "python" or argv[1] == "run":  # torch, a process of its own (and its ranks)
        run = argv[1:] if argv[0] == "python" else ["-m", "schedc", *argv[1:]]
        r = python(*run, "--steps", "2", env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, f"{where}: {cmd}\n{r.stderr}"
        assert "schedc: done: 2 steps" in r.stdout, r.stdout
        return
    if argv[1] == "render" and not argv[-1].endswith(".dot") and not shutil.which("dot"):
        pytest.skip("svg/png/pdf need Graphviz's dot and neato")
    try:
        code = main(argv[1:])
    except SystemExit as e:
        code = e.code
    _, err = capsys.readouterr()
    assert code == 0, f"{where}: {cmd}\n{err}"
    if argv[1] in ("render", "calibrate") and "-o" in argv:
        assert Path(argv[argv.index("-o") + 1]).stat().st_size > 0

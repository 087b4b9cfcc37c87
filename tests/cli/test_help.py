"""Every flag of every verb is in its `--help`, with a description (issue 19).

The flags are read from the parsers themselves (cli/main.build_parser), not from a list
here, so a flag added without a `help=` fails this test. The same holds for
bench/run.py, whose `--help` also lists every case it can run.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys

import pytest

from schedc.cli.main import VERBS, build_parser
from tests.goldens import REPO


def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def described(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments, -h/--help and --version left out (argparse describes them)."""
    return [
        a
        for a in p._actions
        if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
        and not isinstance(a, argparse._SubParsersAction)
    ]


def words(text: str) -> str:
    """Help text as argparse prints it, whitespace folded (it wraps lines)."""
    return re.sub(r"\s+", " ", text)


def test_every_verb_has_a_parser():
    assert set(verb_parsers()) == set(VERBS) and VERBS


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_flag_of_a_verb_is_in_its_help_with_a_description(verb):
    p = verb_parsers()[verb]
    shown = words(p.format_help())
    actions = described(p)
    assert actions, verb
    for a in actions:
        name = "/".join(a.option_strings) or a.dest
        assert a.help and a.help is not argparse.SUPPRESS, f"schedc {verb} {name}: no description"
        assert len(a.help.split()) >= 3, f"schedc {verb} {name}: {a.help!r} describes nothing"
        for opt in a.option_strings:
            assert re.search(rf"(^|[\s,\[]){re.escape(opt)}\b", shown), f"{opt} not in --help"
        # the description itself is printed (its first words; argparse %-expands the rest)
        start = words(a.help).split("%")[0][:30].strip()
        assert start in shown, f"schedc {verb} {name}: description not shown"


def test_device_is_explained():
    """The issue's case: --device's three values were listed and never explained."""
    shown = words(verb_parsers()["run"].format_help())
    for value in ("auto", "cpu", "cuda"):
        assert re.search(rf"\b{value} \(", shown) or f"or {value}" in shown, value
    assert "when torch sees a GPU" in shown


def test_the_top_level_help_lists_every_verb_with_its_summary():
    shown = words(build_parser().format_help())
    for name, verb in VERBS.items():
        assert name in shown and words(verb.HELP)[:30] in shown, name


def _bench_run():
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_help_describes_every_option_and_lists_every_case():
    bench = _bench_run()
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    shown = words(r.stdout)
    for name, what in bench.CASES.items():
        assert f"{name} {words(what)[:40]}" in shown, name
    assert described(bench.parser())
    for a in described(bench.parser()):
        assert a.help and len(a.help.split()) >= 3, f"bench/run.py {a.option_strings}"
        assert words(a.help)[:30] in shown, a.option_strings


def test_bench_refuses_an_unknown_case_naming_the_cases():
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--cases", "loop,nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown case nope" in r.stderr and "schedc-fsdp" in r.stderr

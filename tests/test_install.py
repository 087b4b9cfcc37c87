"""scripts/install.sh installs once (#29 stumble 6: `make demo` spent about 25 s in pip on
every call, installing with python3 and running with $(PY)).

The script runs in a copy of the repository's top (install.sh, pyproject.toml and a
stand-in `schedc` package) with PYTHON a wrapper that records each pip call and fakes it;
every other call goes to this Python, which has torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.goldens import REPO

pytestmark = pytest.mark.torch  # the check imports torch, as a real install has it


@pytest.fixture
def top(tmp_path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install.sh", tmp_path / "scripts")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "schedc").mkdir()
    (tmp_path / "schedc" / "__init__.py").write_text("")
    wrapper = tmp_path / "py"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "-m pip" ]; then echo "$@" >> {tmp_path}/pip.log; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return tmp_path


def install(top: Path, *mode: str) -> tuple[str, list[str]]:
    env = dict(os.environ, PYTHON=str(top / "py"))
    p = subprocess.run(
        ["bash", "scripts/install.sh", *mode], cwd=top, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    log = top / "pip.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return p.stdout, calls


@pytest.mark.skipif(shutil.which("dot") is None, reason="a test install also wants Graphviz")
def test_a_second_install_does_nothing_until_something_changes(top):
    _, calls = install(top, "test")
    assert calls == ["-m pip install --disable-pip-version-check -q -e .[test]"]
    stamp = (top / ".installed").read_text().split()
    assert stamp[0] == sys.executable and stamp[-1] == "test"
    out, calls = install(top, "test")
    assert calls == [] and "installed already" in out
    out, calls = install(top)  # a test install serves a plain one
    assert calls == [] and "installed already" in out
    with open(top / "pyproject.toml", "a") as f:  # the dependencies changed: again
        f.write("\n# changed\n")
    _, calls = install(top)
    assert calls == ["-m pip install --disable-pip-version-check -q -e ."]
    _, calls = install(top, "test")  # a plain install does not serve a test one
    assert calls == ["-m pip install --disable-pip-version-check -q -e .[test]"]


def test_the_demo_installs_with_the_python_it_runs_with():
    make = (REPO / "Makefile").read_text()
    assert "\tPYTHON=$(PY) scripts/install.sh\n" in make
    assert "PYTHON=$(PY) scripts/tier.sh install scripts/install.sh test" in make


def test_every_package_schedc_imports_is_a_dependency_of_the_plain_install():
    """`make demo` installs schedc without its test extra, and `schedc export` (a core verb)
    then failed for want of safetensors: whatever the package imports is in its own
    dependencies (torch.utils.tensorboard's `tensorboard`, imported only through torch, is
    refused in one line when missing: cli/run.py)."""
    import ast
    import re

    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.match(r"[A-Za-z0-9_.-]+", d).group().replace("-", "_") for d in deps}
    imported = set()
    for path in (REPO / "schedc").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"schedc"}
    assert third_party <= declared, sorted(third_party - declared)

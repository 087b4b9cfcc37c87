"""The package's shape holds: layers only import down, nothing cycles, and the compiler, the
pictures and the CLI work where torch cannot be imported (README, "How it works")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx
import pytest

from tests.goldens import REPO

LAYERS = [
    "cli",
    "tune",
    "exec",
    "viz",
    "analysis",
    "compiler",
    "passes",
    "lang",
    "ir",
    "model",
    "files",
    "errors",
]


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("schedc")


def test_no_module_imports_itself_through_others(graph):
    g = nx.DiGraph()
    for m in graph.modules:
        for dep in graph.find_modules_directly_imported_by(m):
            if dep.startswith("schedc.") and dep != m:
                g.add_edge(m, dep)
    # a package's __init__ is its own node; a cycle through one would show here too
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:5])


def test_the_layer_contracts_hold():
    beside = Path(sys.executable).parent / "lint-imports"  # this interpreter's, in a venv
    exe = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert exe, "import-linter is a test dependency (pip install -e '.[test]')"
    r = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "BROKEN" not in r.stdout and "Contracts: 2 kept, 0 broken" in r.stdout


def test_every_layer_is_a_package_named_in_the_contract():
    top = sorted(
        p.stem if p.is_file() else p.name
        for p in (REPO / "schedc").iterdir()
        if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").exists())
    )
    assert top == sorted(LAYERS)
    contract = (REPO / "pyproject.toml").read_text()
    for layer in LAYERS:
        assert f'"schedc.{layer}' in contract, layer


BLOCK_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` now raises ImportError, as without torch
from schedc.cli.main import main
out = sys.argv[1]
assert main(["check"]) == 0                                     # every bundled schedule
assert main(["check", "schedules/fsdp_prefetch.sched", "--dump", "plan"]) == 0
assert main(["check", "schedules/gpt2_1gpu.sched", "schedules/gpt2_8gpu.sched"]) == 0
assert main(["render", "schedules/ddp_overlap.sched", "-o", out + "/g.dot"]) == 0
assert main(["render", "schedules/fsdp_prefetch.sched", "--view", "timeline",
             "-o", out + "/t.dot"]) == 0
assert main(["tune", "schedules/tiny_fsdp_prefetch.sched", "-o", out + "/best.sched"]) == 0
import schedc.passes.check, schedc.viz.timeline, schedc.analysis.calibrate, schedc.model.arch
import schedc.exec.fuse
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules
               if sys.modules[m] is not None)
print("ok without torch")
"""


def test_the_compiler_and_the_pictures_work_without_torch(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok without torch" in r.stdout
    assert (tmp_path / "g.dot").read_text().startswith("digraph")


def test_run_without_torch_is_a_clear_error_not_a_traceback(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from schedc.cli.main import main\n"
        "sys.exit(main(['run', 'schedules/tiny_1gpu.sched']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "torch" in r.stderr

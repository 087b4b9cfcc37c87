"""Shared test setup: hypothesis profiles, the tiers' marks, and session-wide fixtures.

`pytest` works from anywhere without installing schedc: tests/ is a package, so pytest puts
the checkout's root (tests/goldens.py `REPO`) first on sys.path before importing this file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.goldens import REPO

# Hypothesis profiles (README, "Testing"). `ci` is derandomized (the same examples on
# every run) and sized so the whole of .ci/run fits 10 minutes on 2 cores; `long` runs ten
# times the examples, freshly random each run (a failure prints its reproduction blob).
# Selected by SCHEDC_PROFILE (ci when CI is set, and by default), or --hypothesis-profile.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile("long", settings.get_profile("ci"), max_examples=1000, derandomize=False)
settings.load_profile(os.environ.get("SCHEDC_PROFILE") or "ci")


# Tiers (README, "Testing"). Tests under exec/ and model/ need torch (the executor, the torch
# model, data as tensors), and so do a few elsewhere that run `schedc run`; they are marked
# `torch` here or in their module. `pytest -m "not torch"` is the torch-free tier: the
# compiler, the pictures and the CLI, which must work on a machine without torch (CI runs it
# in a venv without torch). `ranks` marks tests that start real torch.distributed ranks.
# `faults` marks the tests that kill, stop or crash a rank or a save, or resume from what is
# left (slow: they wait out timeouts and restarts); each needs torch, so `-m torch` runs them
# and `-m "torch and not faults"` is the quick loop.
TORCH_DIRS = ("exec", "model")
TORCH_FREE = {"test_fuse.py"}  # exec/fuse.py groups ops; it never imports torch
try:
    import torch  # noqa: F401

    collect_ignore_glob: list[str] = []
except ImportError:  # the torch-free tier: these modules import torch when collected
    collect_ignore_glob = [f"{d}/test_*.py" for d in TORCH_DIRS]


def pytest_ignore_collect(collection_path: Path, config):
    if collect_ignore_glob and collection_path.name in TORCH_FREE:
        return False  # collected even without torch
    return None


class GroupsTook:
    """Under `--dist loadgroup` a test of an xdist_group must carry its group in its id (how
    pytest-xdist's scheduler keeps a group on one worker): where a pytest and pytest-xdist
    pairing loses it (pytest 9.2 with pytest-xdist 3.8), the tests would be scattered over
    the workers (a rank pool started on each, per-process counts split) without a word.
    Each such test fails instead, saying why, before it runs."""

    def __init__(self):
        self.lost: set[str] = set()

    @pytest.hookimpl(trylast=True)  # after pytest-xdist's, which writes the group into the id
    def pytest_collection_modifyitems(self, config, items):
        if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
            self.lost = {
                item.nodeid
                for item in items
                if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
            }

    def pytest_runtest_setup(self, item):
        if item.nodeid in self.lost:
            pytest.fail(
                f"its xdist_group {item.get_closest_marker('xdist_group').args[0]!r} did not "
                "reach its id, so pytest-xdist does not keep the group on one worker (pytest "
                "and pytest-xdist disagree on a node's id: see pyproject.toml's pin on pytest)",
                pytrace=False,
            )


def pytest_configure(config):
    from tests.strategies import SummaryPlugin  # the generated cases' tally, printed at the end

    config.pluginmanager.register(SummaryPlugin(), "schedc-summary")
    config.pluginmanager.register(GroupsTook(), "schedc-groups")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name in TORCH_DIRS and path.name not in TORCH_FREE:
            item.add_marker(pytest.mark.torch)
        if item.get_closest_marker("faults"):
            item.add_marker(pytest.mark.torch)
        fixtures = set(getattr(item, "fixturenames", ()))
        on = item.get_closest_marker("on_pool")
        if "pool" in fixtures or "pool8" in fixtures or on is not None:
            item.add_marker(pytest.mark.ranks)
            # one pool, on one worker; the 8-rank pool's few tests on a worker of their own
            # (its start-up, 8 ranks importing torch on two cores, off the 4-rank pool's queue)
            big = "pool8" in fixtures or (on is not None and on.args[0] > 4)
            item.add_marker(pytest.mark.xdist_group("pool8" if big else "pool"))
        if "real_trace" in fixtures:  # a trace that `schedc run` writes first (viz/conftest.py)
            item.add_marker(pytest.mark.torch)
            item.add_marker(pytest.mark.xdist_group("real_trace"))  # written once


@pytest.fixture(autouse=True)
def _reap_children():
    """A process a test started through tests/ranks.py does not outlive the test."""
    yield
    ranks = sys.modules.get("tests.ranks")  # imported only by the tests that start processes
    if ranks is not None:
        ranks.reap()


@pytest.fixture(scope="session")
def repo() -> Path:
    """The root of the checkout (schedules/, grammar/, docs/ live here)."""
    return REPO


@pytest.fixture(scope="session")
def pool():
    """Real gloo ranks (tests/pool.py), started once per session, not once per test."""
    from tests.pool import Pool

    p = Pool()
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool8():
    """Eight real gloo ranks, for the world-8 pipeline (HSDP per stage: degree 2 x replicate 2
    x shard 2), started on first use, on the pool's worker (24 s to start on two cores)."""
    from tests.pool import Pool

    p = Pool(8)
    yield p
    p.close()


@pytest.fixture(scope="session")
def reference():
    """reference(text, steps, dtype="float32"): the single-process oracle (tests/oracle.py)."""
    from tests.oracle import reference_steps

    return reference_steps

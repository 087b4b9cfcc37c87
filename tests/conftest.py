"""Shared test setup: the checkout's root, and session-wide fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `pytest` works from anywhere without installing schedc
    sys.path.insert(0, str(REPO))


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
def reference():
    """reference(text, steps, dtype="float32"): the single-process oracle (tests/oracle.py)."""
    from tests.oracle import reference_steps

    return reference_steps

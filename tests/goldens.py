"""Golden files: the one helper every golden test uses, and where the files live; and
REPO, the checkout's root, which every test that reads the checkout imports from here.

`SCHEDC_REGEN=1 python -m pytest ...` rewrites the files a test compares against; without it a
difference fails the test with a unified diff.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
REGEN = os.environ.get("SCHEDC_REGEN") == "1"


def assert_golden(path: Path, text: str) -> None:
    """`text` must equal the file at `path` byte for byte (SCHEDC_REGEN=1 writes it)."""
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; run with SCHEDC_REGEN=1 to write it"
    want = path.read_text()
    if text != want:
        diff = "".join(
            list(
                difflib.unified_diff(
                    want.splitlines(True),
                    text.splitlines(True),
                    f"{path.name} (golden)",
                    f"{path.name} (now)",
                )
            )[:200]
        )
        pytest.fail(f"{path.name} changed (SCHEDC_REGEN=1 accepts the change):\n{diff}")

"""In-process executors at world 1 (with the `world1` fixture of tests/exec/conftest.py)."""

from __future__ import annotations

import itertools

_tags = itertools.count()


def executor(text: str, steps: int = 2, name: str = "t.sched", **opts):
    """An Executor of `text` on the CPU, its stream groups named apart from every other's."""
    from schedc.compiler import compile_text
    from schedc.exec.executor import Executor
    from schedc.exec.options import Comm, RunOptions
    from schedc.lang.resolve import Overrides

    c = compile_text(text, name, Overrides(steps=steps))
    opts = {"device": "cpu", "log": False, **opts}
    return Executor(c, Comm(0, 1, tag=f"local{next(_tags)}"), RunOptions(**opts))

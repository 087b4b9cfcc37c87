"""Fixtures of the executor tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def world1():
    """A one-process gloo world for in-process executors (tests/world1.py `executor`)."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()

"""A resume continues the saved run's token stream and LR schedule, or is refused (#29 stumble 5).

A checkpoint records the data's fingerprint, the sequences read so far and the step the LR's
cosine decay ends at (meta.json "stream"). A resume that would read other tokens, start
elsewhere in the stream, or decay over another horizon (`--resume ck --steps 10` on a
20-step file used to change the lr at step 6 from 2.989e-3 to 2.742e-3, silently) is a
one-line CheckpointError that says what differs and how to resume as saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from schedc.compiler import compile_text
from schedc.exec.checkpoint import store
from schedc.exec.checkpoint.layout import CheckpointError
from tests.goldens import REPO

pytestmark = pytest.mark.torch

TINY = (REPO / "schedules" / "tiny_1gpu.sched").read_text()


def executor(text: str, steps: int):
    from schedc.compiler import compile_text
    from schedc.exec.executor import Executor
    from schedc.exec.options import Comm, RunOptions
    from schedc.lang.resolve import Overrides

    compiled = compile_text(text, "tiny.sched", Overrides(steps=steps))
    return Executor(compiled, Comm(0, 1), RunOptions(device="cpu", log=False))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """tiny_1gpu on 20 steps, saved after its first."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = tmp_path_factory.mktemp("stream") / "ck"
    ex = executor(TINY, 20)
    ex.step()
    store.save(ex, root)
    ex.close()
    yield root
    dist.destroy_process_group()


def test_the_checkpoint_records_its_stream(saved):
    meta = json.loads((saved / "step_00000001" / "meta.json").read_text())
    assert meta["format"] == 2
    assert meta["stream"]["sequences"] == 16 and meta["stream"]["lr_horizon"] == 20
    assert len(meta["stream"]["data"]) == 16


def test_the_same_schedule_resumes(saved):
    ex = executor(TINY, 20)
    assert store.load(ex, saved) == 1
    ex.close()


def test_another_step_count_would_change_the_lr_schedule(saved):
    ex = executor(TINY, 10)
    with pytest.raises(CheckpointError) as e:
        store.load(ex, saved)
    msg = str(e.value)
    assert "decays over 20 steps; this run's decays over 10" in msg
    assert "resume with --steps 20" in msg and "decay_steps = 20" in msg
    # saved at step 1, in the warmup (5 steps), where both schedules agree: the message names
    # the first step they differ at, not two equal numbers ("2.4000e-03, not 2.4000e-03")
    opt = ex.spec.optim
    assert opt.lr_at(1, 10) == opt.lr_at(1, 20)
    assert f"lr at step 6: {opt.lr_at(6, 10):.4e}, not {opt.lr_at(6, 20):.4e}" in msg
    assert opt.lr_at(6, 10) != opt.lr_at(6, 20)
    ex.close()


def test_the_first_step_whose_rate_differs_is_what_decides():
    """Two horizons that both end inside the warmup give every step the same rate (the warmup's,
    then min_lr): nothing to refuse. Others differ first one step into the decays, which both start at lr."""
    opt = compile_text(TINY, "tiny.sched").spec.optim
    assert opt.warmup == 5
    assert store.first_lr_difference(opt, 1, 3, 4) is None
    assert store.first_lr_difference(opt, 1, 10, 20) == 6  # step 5 starts both decays at lr
    assert store.first_lr_difference(opt, 7, 10, 20) == 7


def test_a_fixed_horizon_lets_the_run_stop_elsewhere(saved):
    fixed = TINY.replace("warmup = 5 }", "warmup = 5  decay_steps = 20 }")
    ex = executor(fixed, 10)
    assert store.load(ex, saved) == 1
    ex.close()


def test_other_data_is_refused(saved, tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 500, 50_000, dtype=np.uint16).tofile(tokens)
    ex = executor(TINY.replace("data corpus", f'data tokens "{tokens}"'), 20)
    with pytest.raises(CheckpointError, match="a resume continues the same token stream"):
        store.load(ex, saved)
    ex.close()


def test_another_global_batch_would_start_elsewhere_in_the_stream(saved):
    ex = executor(TINY.replace("batch 16 x 64", "batch 8 x 64"), 20)
    with pytest.raises(CheckpointError) as e:
        store.load(ex, saved)
    assert "saved after 16 sequences" in str(e.value) and "would start at 8" in str(e.value)
    ex.close()


def test_a_format_1_checkpoint_still_resumes(saved, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(saved, old)
    meta_file = old / "step_00000001" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["format"] = 1
    del meta["stream"], meta["unit_params"]
    meta_file.write_text(json.dumps(meta))
    ex = executor(TINY, 10)  # nothing recorded to compare
    assert store.load(ex, old) == 1
    ex.close()

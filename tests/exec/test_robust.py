"""Run-time faults end cleanly, and checkpoints lose nothing (real processes, gloo).

Ranks are launched by hand here (tests/ranks.py `start_ranks`), not by torchrun: torchrun
kills the survivors the moment one worker dies, and these tests want to see what a
survivor itself reports. Under torchrun, and a stopped rank: tests/exec/test_torchrun_failures.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from schedc.exec.checkpoint.dcp_metadata import SafeReader
from schedc.exec.checkpoint.files import find
from schedc.exec.checkpoint.meta_json import verify
from schedc.exec.checkpoint.store import CRASH_ENV
from tests.exec.test_equivalence import DDP_CASES
from tests.goldens import REPO
from tests.pool import JobFailed
from tests.ranks import finish, start_ranks, wait_for_step

SCHEDULES = REPO / "schedules"


def launch(world: int, *args: str, env: dict | None = None):
    """`schedc run ARGS` as `world` processes, each its own rank, one thread each (at world 1
    too: pytest-xdist's two workers share two cores)."""
    return start_ranks([args] * world, {"OMP_NUM_THREADS": "1", **(env or {})})


def run(world: int, *args: str, env: dict | None = None) -> list[tuple[int, str, str]]:
    return finish(launch(world, *args, env=env))


# -- dead and stuck ranks ------------------------------------------------------------------------


@pytest.mark.faults
def test_a_killed_rank_is_named_by_the_survivor_within_the_bound():
    procs = launch(
        2, str(SCHEDULES / "tiny_ddp_overlap.sched"), "--steps", "10000", "--timeout", "20"
    )
    wait_for_step(procs[0], 2)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    (code, _, err), _ = finish(procs, timeout=60)
    assert time.monotonic() - t0 < 30
    assert code == 1
    assert "rank 1 stopped answering" in err
    assert "error on rank 0" in err and "instruction" in err  # where it was waiting
    assert "Traceback" not in err


# -- numerics -----------------------------------------------------------------------------------


def test_a_nan_gradient_stops_the_run_with_the_step_named(pool):
    with pytest.raises(JobFailed) as e:
        pool.run(DDP_CASES["w2-two-buckets-k2"], 2, steps=3, fault="nan-grad step1")
    assert "step 1: the gradient norm is nan" in str(e.value)


def test_nonfinite_skip_skips_the_update_and_says_so(pool):
    res = pool.run(DDP_CASES["w2-two-buckets-k2"], 2, steps=3, fault="nan-grad step1 skip")
    assert [bool(s.skipped) for s in res.steps] == [False, True, False]
    assert "step 1" in res.steps[1].skipped


# -- checkpoints ----------------------------------------------------------------------------------


def losses(path: Path, key: str = "loss") -> dict[int, float]:
    """--log-json's `key` by step: the training loss, or `val_loss` where one was measured."""
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r[key] for r in records if key in r}


def on_shards(sched: str, tmp_path: Path) -> str:
    """`sched` reading 4 train shards of 20 sequences of 64 tokens (2.5 of its steps each)
    and a val shard, validated every 2 steps: a kill after step 2 lands mid-shard."""
    from schedc.model.data import corpus_tokens
    from tests.model.test_shards import make_shards_py

    d = tmp_path / "shards"
    make_shards_py.make_shards(np.asarray(corpus_tokens()[: 5 * 1300]), d, 1300)
    text = (
        (SCHEDULES / sched)
        .read_text()
        .replace("data corpus", f'data "{d}/"\neval {{ val_every = 2  val_batches = 2 }}')
    )
    (tmp_path / "s.sched").write_text(text)
    return str(tmp_path / "s.sched")


def final_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read in one process with schedc's safe reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = find(ckpt)
    verify(path)
    reader = SafeReader(str(path))
    md = reader.read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: it does
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.faults
# (DDP's form, every parameter whole, resumes after a kill in tests/exec/test_pipeline_checkpoint.py,
# by a pipeline run and as DP 4)
@pytest.mark.parametrize("sched", ["tiny_fsdp_prefetch.sched+shards"])
def test_resume_after_a_kill_is_bitwise_identical(tmp_path, sched):
    """Killed after the step-2 checkpoint and resumed: the same losses, bitwise. The FSDP case
    reads token shards and validates, so the kill lands mid-shard and the resumed run
    crosses shards and measures validation losses that must equal the straight run's too."""
    name, _, shards = sched.partition("+")
    f = on_shards(name, tmp_path) if shards else str(SCHEDULES / name)
    straight = tmp_path / "straight"
    (code, _, err), _ = run(
        2,
        f,
        "--steps",
        "6",
        "--save",
        str(straight),
        "--save-every",
        "6",
        "--log-json",
        str(tmp_path / "straight.jsonl"),
    )
    assert code == 0, err
    ck = tmp_path / "ck"
    procs = launch(
        2,
        f,
        "--steps",
        "6",
        "--save",
        str(ck),
        "--save-every",
        "2",
        "--log-json",
        str(tmp_path / "a.jsonl"),
    )
    deadline = time.monotonic() + 120
    while not (ck / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        p.kill()  # mid-run, after the first checkpoint
    finish(procs)
    (code, out, err), _ = run(
        2,
        f,
        "--steps",
        "6",
        "--save",
        str(ck),
        "--save-every",
        "6",
        "--resume",
        str(ck),
        "--log-json",
        str(tmp_path / "b.jsonl"),
    )
    assert code == 0, err
    assert "resumed from" in out
    want, got = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "b.jsonl")
    assert got and all(got[s] == want[s] for s in got), (got, want)  # bitwise: == on floats
    if shards:
        val, val_want = (
            losses(tmp_path / "b.jsonl", "val_loss"),
            losses(tmp_path / "straight.jsonl", "val_loss"),
        )
        assert val == {s: val_want[s] for s in (3, 5)}, (val, val_want)
    a, b = final_state(straight), final_state(ck)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.faults
def test_hsdp_resumes_bitwise_after_a_rank_is_killed_while_saving(tmp_path):
    """HSDP 2 x 2, saving every 2 steps: rank 1 dies (SIGKILL) as step 4's save begins, and
    the job ends. Resumed from step 2's checkpoint, steps 2 and 3 are the ones the killed run
    logged, bitwise: a unit is a DTensor on the mesh, sharded over S, replicated over R."""
    f, ck = str(SCHEDULES / "tiny_hsdp.sched"), tmp_path / "ck"
    codes = run(4, f, "--steps", "4", "--save", str(ck), "--save-every", "2", "--timeout", "20",
                "--log-json", str(tmp_path / "killed.jsonl"),
                env={CRASH_ENV: "before-write@1#4"})  # fmt: skip
    assert any(c != 0 for c, _, _ in codes)
    (code, out, err), *_ = run(4, f, "--steps", "4", "--resume", str(ck),
                               "--log-json", str(tmp_path / "resumed.jsonl"))  # fmt: skip
    assert code == 0, err
    assert "at step 2" in out, out
    want, got = losses(tmp_path / "killed.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert sorted(want) == [0, 1, 2, 3]  # the killed run stopped in step 4's save
    assert got == {s: want[s] for s in (2, 3)}  # bitwise: == on floats


@pytest.mark.faults
def test_fsdp_checkpoint_resumes_at_another_world_size(tmp_path):
    two = SCHEDULES / "tiny_fsdp_prefetch.sched"
    one = tmp_path / "one.sched"  # the same model, global batch and units, on one rank
    one.write_text(two.read_text().replace("world 2", "world 1").replace("micro 2", "micro 4"))
    ck = tmp_path / "ck"
    (code, _, err), _ = run(
        2,
        str(two),
        "--steps",
        "4",
        "--save",
        str(ck),
        "--save-every",
        "2",
        "--log-json",
        str(tmp_path / "two.jsonl"),
    )
    assert code == 0, err
    ((code, out, err),) = run(
        1,
        str(one),
        "--steps",
        "4",
        "--resume",
        str(ck / "step_00000002"),
        "--log-json",
        str(tmp_path / "one.jsonl"),
    )
    assert code == 0, err
    want, got = losses(tmp_path / "two.jsonl"), losses(tmp_path / "one.jsonl")
    assert sorted(got) == [2, 3]
    for s in got:  # another world sums in another order: equal to fp32 rounding
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """tiny_1gpu.sched run 2 steps, checkpointed at step 2: what the tests below damage or
    crash on top of (each gets its own copy, `fresh`). The schedule, `tiny(saved)`, fixes
    its LR horizon (`decay_steps`), so that the tests may resume it with other --steps."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    tiny(ck).write_text(
        (SCHEDULES / "tiny_1gpu.sched")
        .read_text()
        .replace("warmup = 5 }", "warmup = 5  decay_steps = 40 }")
    )
    ((code, _, err),) = run(
        1,
        str(tiny(ck)),
        "--steps",
        "2",
        "--save",
        str(ck),
        "--save-every",
        "2",
    )
    assert code == 0, err
    return ck


def tiny(saved: Path) -> Path:
    """tiny_1gpu.sched with a fixed LR horizon, beside the `saved` checkpoint."""
    return saved.parent / "tiny.sched"


def fresh(saved: Path, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    return ck


@pytest.mark.faults
@pytest.mark.parametrize("point", ["before-write", "after-write", "before-rename", "before-latest"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(saved, tmp_path, point):
    ck = fresh(saved, tmp_path)
    # the next save (step 4) dies at `point`
    ((code, _, _),) = run(
        1,
        str(tiny(saved)),
        "--steps",
        "4",
        "--resume",
        str(ck),
        "--save",
        str(ck),
        "--save-every",
        "2",
        env={CRASH_ENV: point},
    )
    assert code != 0
    # what a resume reads first, in this process (a run's resume of a whole checkpoint is
    # the tests above): `latest` names a whole checkpoint, its hashes and DCP metadata hold
    path = find(ck)
    meta = verify(path)
    SafeReader(str(path), meta).read_metadata()
    assert meta["step"] in (2, 4)  # the old one, or the new one if it was complete


def _corrupt(ck: Path, how: str) -> None:
    path = ck / (ck / "latest").read_text().strip()
    data = path / "__0_0.distcp"
    blob = data.read_bytes()
    if how == "truncate":
        data.write_bytes(blob[: len(blob) // 2])
    elif how == "flip":
        data.write_bytes(blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:])
    elif how == "evil-metadata":  # a pickle that runs code, with the manifest "fixed" to match
        import hashlib

        class Evil:
            def __reduce__(self):
                return (os.system, ("touch " + str(ck / "pwned"),))

        (path / ".metadata").write_bytes(pickle.dumps(Evil()))
        meta = json.loads((path / "meta.json").read_text())
        meta["files"][".metadata"] = hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()
        (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.faults
@pytest.mark.parametrize(
    "how,message",
    [
        ("truncate", "truncated or altered"),
        ("flip", "truncated or altered"),
        ("evil-metadata", "which a DCP checkpoint never does"),
    ],
)
def test_a_damaged_checkpoint_is_a_clear_error(saved, tmp_path, how, message):
    ck = fresh(saved, tmp_path)
    _corrupt(ck, how)
    ((code, out, err),) = run(1, str(tiny(saved)), "--steps", "3", "--resume", str(ck))
    assert code == 1
    assert message in err and "Traceback" not in err, err
    assert not (ck / "pwned").exists()


def test_a_schedule_is_data_never_code():
    """No eval or exec anywhere in schedc: a .sched file can only be parsed."""
    files = sorted((REPO / "schedc").rglob("*.py"))
    assert len(files) > 40  # every layer's package, not only the top level
    for f in files:
        text = f.read_text()
        assert "eval(" not in text and "exec(" not in text, f.name


def test_ranks_reading_different_data_refuse_to_start(tmp_path):
    """The same schedule text, but `data "text.txt"` is another file on each rank."""
    text = (
        (SCHEDULES / "tiny_ddp_overlap.sched").read_text().replace("data corpus", 'data "text.txt"')
    )
    dirs = []
    for r in range(2):
        d = tmp_path / f"rank{r}"
        d.mkdir()
        (d / "run.sched").write_text(text)
        (d / "text.txt").write_text(
            ("In the beginning was the word. " * 400)
            if r == 0
            else ("Call me Ishmael. Some years ago. " * 400)
        )
        dirs.append(d)
    procs = start_ranks([["run.sched", "--timeout", "60"]] * 2, cwd=dirs)
    for code, out, err in finish(procs, timeout=120):
        assert code == 1, err
        assert "ranks disagree before step 1" in err and "data" in err
        assert "step    0" not in out

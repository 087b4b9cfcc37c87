"""Issue #42, the token data: the ranks' start-up agreement compares every byte each rank
reads (a full hash, not a sample), and a token file that changes under a run or holds ids
that are no token is a one-line DataError naming the file, never a signal or an IndexError.
"""

from __future__ import annotations

import gc
import hashlib
import os
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

import schedc.model.token_files as token_files
from schedc.model.config import DataConfig
from schedc.model.data import DataError, GlobalBatches, fingerprint, load_batches
from tests.goldens import REPO
from tests.ranks import finish, python, start_ranks

T, S = 16, 4
# 8M tokens and a few: the old fingerprint hashed every second token past the first 64K
# at this length, so tokens at odd positions in the middle were never looked at
BIG = (1 << 23) + 1000


def _differing_pair() -> tuple[np.ndarray, np.ndarray]:
    """Two token streams alike but for 32,768 tokens at odd positions from 1M on."""
    a = (np.arange(BIG, dtype=np.int64) * 7919 % 50_000).astype(np.uint16)
    b = a.copy()
    odd = np.arange(1 << 20, (1 << 20) + (1 << 16), 2) + 1
    b[odd] = (b[odd] + 1) % 50_000
    return a, b


def batches(source, vocab=4096, split="train", also=()):
    return load_batches(DataConfig(str(source), "auto", also).resolved(), T, S, vocab, split)


def test_streams_that_differ_anywhere_fingerprint_differently(tmp_path):
    a, b = _differing_pair()
    assert int((a != b).sum()) == 32_768
    assert fingerprint(a) != fingerprint(b)
    a.tofile(tmp_path / "a.bin")
    b.tofile(tmp_path / "b.bin")
    fa, fb = batches(tmp_path / "a.bin"), batches(tmp_path / "b.bin")
    assert fa.fingerprint() != fb.fingerprint()
    # the file is hashed as the array is: a .bin and the ids in memory agree
    assert fa.fingerprint() == fingerprint(a)


def test_the_fingerprint_of_a_small_stream_is_the_one_checkpoints_recorded():
    """Up to 4M tokens the old fingerprint was already exact: a checkpoint saved before the
    full hash still resumes on the same data."""
    ids = np.arange(5000, dtype=np.uint16)
    old = hashlib.sha256(b"5000" + ids.tobytes()).hexdigest()[:16]
    assert fingerprint(ids) == old
    assert GlobalBatches(ids, T, S, 4096).fingerprint() == old


def test_ranks_given_different_data_refuse_to_start(tmp_path):
    """Each rank's `data "tokens.bin"` is another file: alike in length, first and last
    64K tokens and every second token, different in 32,768 others."""
    text = (REPO / "schedules" / "tiny_ddp_overlap.sched").read_text()
    text = text.replace("data corpus", 'data "tokens.bin"')
    assert 'data "tokens.bin"' in text
    dirs = []
    for r, ids in enumerate(_differing_pair()):
        d = tmp_path / f"rank{r}"
        d.mkdir()
        (d / "run.sched").write_text(text)
        ids.tofile(d / "tokens.bin")
        dirs.append(d)
    procs = start_ranks([["run.sched", "--steps", "1", "--timeout", "60"]] * 2, cwd=dirs)
    for code, out, err in finish(procs, timeout=180):
        assert code == 1, err
        assert "ranks disagree before step 1" in err and "data" in err, err
        assert "step    0" not in out


def test_a_shard_truncated_under_a_run_is_named_not_a_signal(tmp_path):
    """The reader is opened, the file is cut short, then a batch past the cut is read: a
    DataError naming the file (with a memory map this was SIGBUS, exit 135)."""
    for name, write in (
        ("cut_train.npy", "np.save(path, ids)"),
        ("cut_train.bin", "ids.tofile(path)"),
    ):
        path = tmp_path / name
        script = textwrap.dedent(
            f"""
            import os, numpy as np
            from schedc.model.config import DataConfig
            from schedc.model.data import DataError, load_batches
            path = {str(path)!r}
            ids = np.arange(1 << 20, dtype=np.uint16)
            {write}
            b = load_batches(DataConfig(path).resolved(), 64, 8, 4096)
            b.global_batch(0)
            os.truncate(path, 4096)
            b.global_batch(0)  # before the cut: read as it was
            try:
                b.global_batch(100)
            except DataError as e:
                print("DataError:", e)
            """
        )
        done = python("-c", script, timeout=120)
        assert done.returncode == 0, (done.returncode, done.stderr)
        message = done.stdout.strip()
        assert message.startswith(f"DataError: {path}: "), message
        assert "\n" not in message and "shorter" in message, message


def test_an_id_outside_the_vocabulary_in_a_second_shard_names_it(tmp_path):
    """uint64 ids past 2**63 turned negative on the way to int64, passed the check of the
    largest id, and ended as IndexError in the embedding."""
    np.save(tmp_path / "a_train.npy", np.full(100, 7, dtype=np.uint64))
    bad = np.full(100, 7, dtype=np.uint64)
    bad[20] = 2**63 + 5
    np.save(tmp_path / "b_train.npy", bad)
    b = batches(f"{tmp_path}/", vocab=50_257)
    b.global_batch(0)
    with pytest.raises(DataError) as e:
        b.global_batch(1)  # its rows reach the second shard
    assert str(e.value).startswith(f"{tmp_path / 'b_train.npy'}: token id {2**63 + 5} ")


def test_token_files_read_with_pread_give_the_rows_the_arrays_give(tmp_path):
    """Shards of uneven lengths, read past their end (the stream wraps) and across their
    borders: the rows read from the files are those indexed in the arrays."""
    rng = np.random.default_rng(7)
    parts = [rng.integers(0, 65_535, n).astype(np.uint16) for n in (17, 100, 33, 250, 16 * 9)]
    for i, p in enumerate(parts):
        np.save(tmp_path / f"s{i}_train.npy", p)
    files = batches(f"{tmp_path}/", vocab=512)
    arrays = GlobalBatches(parts, T, S, 512, origin=[f"p{i}" for i in range(len(parts))])
    assert files.num_seqs == arrays.num_seqs and all(f is not None for f in files._files)
    for step in range(3 * files.num_seqs // S + 2):
        for u, v in zip(files.global_batch(step), arrays.global_batch(step), strict=True):
            assert np.array_equal(u, v), step
    assert files.fingerprint() == arrays.fingerprint()


def test_a_run_keeps_a_few_token_files_open_not_all(tmp_path):
    for i in range(20):
        np.save(tmp_path / f"s{i:02d}_train.npy", np.arange(40, dtype=np.uint16))
    b = batches(f"{tmp_path}/")
    before = len(os.listdir("/proc/self/fd"))
    for step in range(b.num_seqs // S + 1):
        b.global_batch(step)
    assert len(b._open) <= 8 and len(os.listdir("/proc/self/fd")) <= before + 8
    del b
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_shard_replaced_under_a_run_is_named(tmp_path):
    """Another file renamed over a shard: the ranks agreed on the first one's tokens."""
    path = tmp_path / "a_train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    b = batches(path)
    b.global_batch(0)
    b._open.clear()  # as if its descriptor had been closed to make room for others
    np.zeros(1000, dtype=np.uint16).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)
    with pytest.raises(DataError, match=f"^{path}: replaced by another file since the run"):
        b.global_batch(1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Every token file kept in the cache, which lives in tmp_path, and this process's own
    scans forgotten; the clock 10 s ahead, so a file written now is not too new to keep."""
    monkeypatch.setenv("SCHEDC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(token_files, "CACHED_BYTES", 0)
    monkeypatch.setattr(token_files, "time", SimpleNamespace(time=lambda: time.time() + 10))
    monkeypatch.setattr(token_files, "_SCANS", {})
    return tmp_path / "cache" / "fingerprints"


def test_a_large_files_scan_is_kept_between_runs_and_not_past_a_write(tmp_path, cache, monkeypatch):
    path = tmp_path / "big.bin"
    ids = np.arange(5000, dtype=np.uint16)
    ids.tofile(path)
    first = batches(path).fingerprint()
    assert first == fingerprint(ids) and len(list(cache.iterdir())) == 1

    def no_read(*_):
        raise AssertionError("read although kept")

    with monkeypatch.context() as patch:  # a new process: the scan comes from the cache
        patch.setattr(token_files, "_SCANS", {})
        patch.setattr(token_files.TokenFile, "read", no_read)
        assert batches(path).fingerprint() == first
    with open(path, "r+b") as f:  # the same size, one token changed: another entry
        f.seek(2000)
        f.write(b"\x01\x00")
    token_files._SCANS.clear()
    assert batches(path).fingerprint() != first
    assert len(list(cache.iterdir())) == 2


def test_a_cache_entry_that_is_not_schedcs_is_read_again(tmp_path, cache):
    path = tmp_path / "big.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    want = batches(path).fingerprint()
    (entry,) = cache.iterdir()
    for junk in ("", "{", '{"sha256": 1, "min": 0, "max": 1}', '{"sha256": "x"}', "[]"):
        entry.write_text(junk)
        token_files._SCANS.clear()
        assert batches(path).fingerprint() == want


def test_a_file_written_just_now_is_not_kept(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(token_files, "time", time)
    path = tmp_path / "big.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    batches(path).fingerprint()
    assert not cache.exists()

"""Token sources and the global-batch contract: every schedule sees the same sequences."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.model.batching import micro_steps, sequence_ids
from schedc.model.config import DataConfig
from schedc.model.data import (
    DataError,
    GlobalBatches,
    gpt2_encoding,
    load_batches,
    load_tokens,
)
from tests.goldens import REPO


@st.composite
def splits(draw):
    """(S, B, D) with S a whole number of waves of B sequences on D ranks."""
    B = draw(st.integers(1, 8))
    D = draw(st.integers(1, 8))
    k = draw(st.integers(1, 6))
    return k * B * D, B, D


# -- the arithmetic ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(splits(), st.integers(0, 10_000))
def test_slices_tile_the_global_batch(split, step):
    S, B, D = split
    k = micro_steps(S, B, D)
    slices = [sequence_ids(step, r, j, B, D, S) for j in range(k) for r in range(D)]
    assert all(len(s) == B for s in slices)
    ids = [g for s in slices for g in s]
    # Each sequence of the step exactly once, read wave by wave and rank by rank ...
    assert ids == list(range(step * S, (step + 1) * S))
    # ... which is the world-1 split into micro-batches of the same size, in order.
    single = [g for j in range(S // B) for g in sequence_ids(step, 0, j, B, 1, S)]
    assert ids == single


@pytest.mark.parametrize(("S", "B", "D"), [(8, 3, 1), (8, 2, 3), (6, 4, 1), (0, 1, 1)])
def test_split_must_be_whole(S, B, D):
    with pytest.raises(ValueError):
        micro_steps(S, B, D)


def test_out_of_range_rank_or_micro_step():
    with pytest.raises(ValueError, match="rank 2"):
        sequence_ids(0, 2, 0, 2, 2, 8)
    with pytest.raises(ValueError, match="micro-step 2"):
        sequence_ids(0, 0, 2, 2, 2, 8)


def test_batching_needs_neither_torch_nor_numpy():
    code = (
        "import sys, schedc.model.batching as b; "
        "assert list(b.sequence_ids(1, 1, 0, 2, 2, 8)) == [10, 11]; "
        "assert not {'torch', 'numpy'} & set(sys.modules), sorted(sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


# -- tensors -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(splits(), st.integers(0, 50), st.integers(1, 9), st.integers(1, 200))
def test_micro_batches_assemble_the_global_batch(split, step, T, n_tokens):
    S, B, D = split
    tokens = np.random.default_rng(n_tokens).integers(0, 500, size=n_tokens + T + 1)
    batches = GlobalBatches(tokens, T, S, vocab_size=512)
    k = micro_steps(S, B, D)
    parts = [batches.micro_batch(step, r, j, B, D) for j in range(k) for r in range(D)]
    for x, y in parts:
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    x, y = batches.global_batch(step)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_sequences_wrap_at_the_end_of_the_data():
    T = 4
    tokens = np.arange(3 * T + 2)  # three whole sequences (and one spare token)
    batches = GlobalBatches(tokens, T, global_seqs=4, vocab_size=512)
    assert batches.num_seqs == 3
    x, y = batches.global_batch(1)  # global ids 4..7 -> data sequences 1, 2, 0, 1
    for row, d in enumerate([1, 2, 0, 1]):
        assert x[row].tolist() == list(range(d * T, (d + 1) * T))
        assert y[row].tolist() == list(range(d * T + 1, (d + 1) * T + 1))


def test_small_vocabularies_fold_gpt2_ids():
    tokens = np.array([50000, 7, 511, 512, 1025, 50256], dtype=np.uint16)
    x, y = GlobalBatches(tokens, 5, 1, vocab_size=512).global_batch(0)
    assert x.tolist() == [[50000 % 512, 7, 511, 0, 1]]
    assert y.tolist() == [[7, 511, 0, 1, 50256 % 512]]


def test_full_vocabularies_do_not_fold():
    tokens = np.array([1, 2, 50256, 3], dtype=np.uint16)
    x, _ = GlobalBatches(tokens, 3, 1, vocab_size=50304).global_batch(0)  # padded vocab
    assert x.tolist() == [[1, 2, 50256]]
    with pytest.raises(DataError, match=r"shard\.bin: token id 50257 is outside"):
        GlobalBatches(np.array([1, 50257, 2]), 2, 1, vocab_size=50257, origin="shard.bin")


def test_too_short_for_one_sequence():
    with pytest.raises(DataError, match="mine: 4 tokens are too few"):
        GlobalBatches(np.arange(4), 4, 1, vocab_size=512, origin="mine")


# -- sources -----------------------------------------------------------------------------

TEXT = "In the beginning God created the heaven and the earth.\n" * 20


def test_text_file(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert load_tokens(path).tolist() == gpt2_encoding().encode_ordinary(TEXT)


def test_token_files(tmp_path):
    ids = np.array(gpt2_encoding().encode_ordinary(TEXT), dtype=np.uint16)
    raw = tmp_path / "train.bin"  # nanoGPT: raw uint16
    ids.tofile(raw)
    npy = tmp_path / "shard_000001.npy"  # build-nanogpt: np.save of uint16
    np.save(npy, ids)
    llmc = tmp_path / "llmc.bin"  # llm.c: 256 int32 header, then uint16
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, ids.size]
    llmc.write_bytes(header.tobytes() + ids.tobytes())
    other = tmp_path / "tokens.dat"
    ids.tofile(other)
    for tokens in (
        load_tokens(raw),
        load_tokens(npy),
        load_tokens(llmc),
        load_tokens(other, kind="tokens"),
    ):
        assert np.array_equal(tokens, ids)


def test_load_batches_from_config(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(TEXT, encoding="utf-8")
    batches = load_batches(DataConfig(source=str(path)), 16, 4, vocab_size=512)
    assert batches.origin == str(path) and batches.num_seqs > 4
    with pytest.raises(DataError, match=r"book\.txt: .* too few"):
        load_batches(DataConfig(source=str(path)), 1024, 4, vocab_size=512)
    corpus = load_batches(DataConfig(), 64, 8, vocab_size=50257)
    assert corpus.num_seqs > 5000


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("name", "data", "kind", "message"),
    [
        ("missing.txt", None, "auto", "no such file"),
        ("missing.bin", None, "auto", "no such file"),
        ("missing.npy", None, "auto", "no such file"),
        ("empty.txt", b"", "auto", "empty"),
        ("empty.bin", b"", "auto", "empty"),
        ("odd.bin", b"\x01\x00\x02", "auto", "not a whole number of uint16 tokens"),
        ("image.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "auto", "binary file"),
        ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "auto", "not UTF-8"),
        ("garbage.npy", b"this is not numpy", "auto", "not a .npy array"),
        ("odd.dat", b"\x01\x00\x02", "tokens", "not a whole number"),
    ],
)
def test_unusable_files_name_the_file(tmp_path, name, data, kind, message):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(DataError, match=message) as err:
        load_tokens(path, kind)
    assert str(err.value).startswith(f"{path}: ")


def test_unusable_npy_arrays(tmp_path):
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros((2, 3), dtype=np.float32))
    negative = tmp_path / "negative.npy"
    np.save(negative, np.array([1, -2, 3], dtype=np.int32))
    with pytest.raises(DataError, match=r"floats\.npy: expected a 1-D integer array"):
        load_tokens(floats)
    with pytest.raises(DataError, match=r"negative\.npy: holds negative token ids"):
        load_tokens(negative)


def test_corrupt_llmc_header(tmp_path):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, 100]  # claims 100 tokens, holds 10
    path = _write(tmp_path / "short.bin", header.tobytes() + np.arange(10, dtype="<u2").tobytes())
    with pytest.raises(DataError, match=r"short\.bin: corrupt llm\.c token file"):
        load_tokens(path)


def test_unknown_kind():
    with pytest.raises(ValueError, match="data kind"):
        load_tokens("corpus", kind="parquet")

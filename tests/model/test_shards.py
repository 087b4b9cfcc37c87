"""Token shards (issue #29): a directory, a glob or a written list of build-nanogpt `.npy` or
llm.c `.bin` files is one memory-mapped stream, split into train and val by file name, in an
order that is part of the data's fingerprint. The shards come from scripts/make_shards.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.model.config import DataConfig
from schedc.model.data import DataError, GlobalBatches, corpus_tokens, load_batches
from tests.goldens import REPO

T, S, VOCAB = 16, 4, 512
_spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts/make_shards.py")
assert _spec and _spec.loader
make_shards_py = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_shards_py)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The embedded corpus as six shards of 4,000 ids: val 0, train 1-5 (and the ids)."""
    d = tmp_path_factory.mktemp("shards")
    ids = make_shards_py.tokens_of(
        "\n\n".join(["The first paragraph of a book.", "A second one, a little longer."] * 1500)
    )
    make_shards_py.make_shards(ids[:24_000], d, 4_000, "book")
    return d, ids[:24_000]


def batches(source, split="train", kind="auto", vocab=VOCAB, also=()):
    return load_batches(DataConfig(str(source), kind, also).resolved(), T, S, vocab, split)


def expected_rows(parts: list[np.ndarray], ids: range) -> np.ndarray:
    """The rule, written out: each part holds (len - 1) // T sequences, none crossing into
    the next; global id g reads sequence g mod total."""
    seqs = [p[i * T : i * T + T + 1] for p in parts for i in range((len(p) - 1) // T)]
    return np.stack([seqs[g % len(seqs)] for g in ids]).astype(np.int64) % VOCAB


def test_the_script_writes_build_nanogpts_layout(shards):
    d, ids = shards
    names = sorted(p.name for p in d.iterdir())
    assert names == [f"book_train_{i:06d}.npy" for i in range(1, 6)] + ["book_val_000000.npy"]
    assert np.load(d / "book_val_000000.npy").dtype == np.uint16
    assert ids[0] == 50256  # <|endoftext|> opens every document


def test_a_directory_is_train_and_val_by_name_memory_mapped(shards):
    d, ids = shards
    train, val = batches(f"{d}/"), batches(f"{d}/", "val")
    assert len(train.shards) == 5 and len(val.shards) == 1
    assert all(isinstance(s, np.memmap) for s in train.shards + val.shards)
    parts = [ids[i : i + 4000] for i in range(4000, 24_000, 4000)]
    assert train.num_seqs == 5 * ((4000 - 1) // T)
    for step in (0, 7, 300):  # 300: past the end, wrapped
        x, y = train.global_batch(step)
        rows = expected_rows(parts, range(step * S, step * S + S))
        assert np.array_equal(x.numpy(), rows[:, :-1]) and np.array_equal(y.numpy(), rows[:, 1:])
    x, _ = val.global_batch(0)
    assert np.array_equal(x.numpy(), expected_rows([ids[:4000]], range(S))[:, :-1])


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(T + 1, 6 * T), min_size=1, max_size=5),
    step=st.integers(0, 40),
    rank=st.integers(0, 3),
)
def test_shards_read_sequence_by_sequence_in_their_order(lengths, step, rank):
    rng = np.random.default_rng(len(lengths) * 1000 + step)
    parts = [rng.integers(0, 60_000, n).astype(np.uint16) for n in lengths]
    b = GlobalBatches(parts, T, S, VOCAB, origin=[f"p{i}" for i in range(len(parts))])
    x, y = b.micro_batch(step, rank % 2, 0, 2, 2)
    from schedc.model.batching import sequence_ids

    rows = expected_rows(parts, sequence_ids(step, rank % 2, 0, 2, 2, S))
    assert np.array_equal(x.numpy(), rows[:, :-1]) and np.array_equal(y.numpy(), rows[:, 1:])


def test_one_shard_reads_as_the_single_file_did(tmp_path):
    tokens = corpus_tokens()[:5000]
    np.save(tmp_path / "one.npy", tokens)
    a = GlobalBatches(tokens, T, S, VOCAB)
    b = batches(tmp_path / "one.npy")
    assert a.fingerprint() == b.fingerprint()
    for step in (0, 3, 100):
        assert all(np.array_equal(u, v) for u, v in zip(a.global_batch(step), b.global_batch(step)))


def test_llmc_bin_shards_read_as_the_npy_ones(shards, tmp_path):
    d, ids = shards
    make_shards_py.make_shards(ids, tmp_path, 4_000, "book", fmt="bin")
    a, b = batches(f"{d}/"), batches(tmp_path / "book_*.bin")  # a glob, too
    assert [p.split("/")[-1][:-4] for p in a.origins] == [p.split("/")[-1][:-4] for p in b.origins]
    assert a.fingerprint() == b.fingerprint()
    assert all(np.array_equal(u, v) for u, v in zip(a.global_batch(5), b.global_batch(5)))


def test_the_order_is_part_of_the_fingerprint(shards):
    d, _ = shards
    one, two = str(d / "book_train_000001.npy"), str(d / "book_train_000002.npy")
    ab, ba = batches(one, also=(two,)), batches(two, also=(one,))
    assert ab.fingerprint() != ba.fingerprint()
    assert not np.array_equal(ab.global_batch(0)[0], ba.global_batch(0)[0])
    assert batches(f"{d}/book_train_00000[12].npy").fingerprint() == ab.fingerprint()


@pytest.mark.parametrize(
    "source, also, split, message",
    [
        ("{d}/book_train_*.npy", (), "val", "no val shard"),
        ("{d}/nothing_*.npy", (), "train", "matches no .npy or .bin token file"),
        ("{d}/", ("{d}/book_train_000001.npy",), "train", "named by two data sources"),
        ("{empty}/", (), "train", "a directory without .npy or .bin token shards"),
    ],
)
def test_shards_that_cannot_be_read_are_named(shards, tmp_path, source, also, split, message):
    d, _ = shards
    (tmp_path / "empty").mkdir()
    fill = {"d": d, "empty": tmp_path / "empty"}
    with pytest.raises(DataError, match=message):
        batches(source.format(**fill), split, also=tuple(a.format(**fill) for a in also))


def test_a_directory_written_as_a_text_file_is_told_how_to_read_it(shards):
    d, _ = shards
    with pytest.raises(DataError, match=f'write `data "{d}/"`'):
        batches(d)


def test_ids_outside_a_full_vocabulary_are_refused_when_read(tmp_path):
    np.save(tmp_path / "a_train.npy", np.full(100, 7, dtype=np.uint16))
    np.save(tmp_path / "b_train.npy", np.full(100, 60_000, dtype=np.uint16))
    b = batches(f"{tmp_path}/", vocab=50_257)  # opened without reading either whole
    b.global_batch(0)
    with pytest.raises(DataError, match="b_train.npy: token id 60000 is outside"):
        b.global_batch(1)  # its rows reach the second shard


def test_ranks_on_shards_compute_what_one_process_computes(shards, pool, reference):
    """FSDP at world 2 over the train shards: the executor's rows are the reference's."""
    d, _ = shards
    from tests.oracle import assert_matches

    text = f"""model nano
world 2
batch 8 x {T}
micro 2
seed 3
data "{d}/"
fsdp {{ unit all = embed .. head }}
"""
    assert_matches(pool.run(text, 2, 2), reference(text, 2))

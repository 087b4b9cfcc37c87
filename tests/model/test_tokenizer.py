"""GPT-2's tokenizer, built from the shipped BPE ranks without touching the network."""

from __future__ import annotations

import gzip
import textwrap
from importlib import resources

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.model.data import EOT, EOT_ID, corpus_tokens, gpt2_encoding, load_tokens
from tests.ranks import python


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("Hello world", [15496, 995]),
        ("Hello, world!", [15496, 11, 995, 0]),
        (" the", [262]),
        ("The", [464]),
        (".", [13]),
        ("\n", [198]),
    ],
)
def test_known_gpt2_ids(text, ids):
    assert gpt2_encoding().encode(text) == ids


def test_vocabulary_and_end_of_text():
    enc = gpt2_encoding()
    assert enc.n_vocab == 50257
    assert enc.eot_token == EOT_ID == 50256
    assert enc.encode(EOT, allowed_special={EOT}) == [50256]
    assert enc.decode([50256]) == EOT
    with pytest.raises(ValueError):  # special tokens in plain text are refused by default
        enc.encode(EOT)
    assert 50256 not in enc.encode_ordinary(EOT)  # and are just text to encode_ordinary


def test_encoding_is_built_once():
    assert gpt2_encoding() is gpt2_encoding()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_round_trip(text):
    enc = gpt2_encoding()
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_corpus_tokens():
    text = gzip.decompress(
        (resources.files("schedc") / "assets" / "corpus.txt.gz").read_bytes()
    ).decode("utf-8")
    tokens = corpus_tokens()
    assert tokens.dtype == np.uint16 and not tokens.flags.writeable
    assert tokens.size > 300_000 and int(tokens.max()) < 50257
    assert load_tokens("corpus") is tokens  # tokenized once per process
    assert tokens.tolist() == gpt2_encoding().encode_ordinary(text)
    assert gpt2_encoding().decode(tokens.tolist()) == text


def test_builds_without_network(tmp_path):
    # A fresh process whose sockets and tiktoken's downloading entry point both fail, with
    # an empty tiktoken cache: the encoding and the corpus must come from the package alone.
    script = textwrap.dedent(
        """
        import socket

        import tiktoken

        from schedc.model.data import corpus_tokens, gpt2_encoding

        def refuse(*args, **kwargs):
            raise RuntimeError("network access attempted")

        socket.socket.connect = socket.socket.connect_ex = refuse
        socket.create_connection = socket.getaddrinfo = refuse
        tiktoken.get_encoding = refuse

        assert gpt2_encoding.cache_info().currsize == 0  # built below, under the patches
        assert gpt2_encoding().encode("Hello world") == [15496, 995]
        assert corpus_tokens().size > 300_000
        print("ok")
        """
    )
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken-cache")}
    done = python("-c", script, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

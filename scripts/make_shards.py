"""Token shards as build-nanogpt's fineweb.py writes them, from the bundled corpus or any text.

    python scripts/make_shards.py -o shards/                      # the embedded corpus
    python scripts/make_shards.py -o shards/ --text book.txt --shard-tokens 1000000
    python scripts/make_shards.py -o shards/ --format bin         # llm.c's .bin (1 KiB header)

Documents (paragraphs of the text, split at blank lines) are tokenized with GPT-2's BPE, each
preceded by <|endoftext|>, and packed into shards of exactly --shard-tokens uint16 ids (the
last one shorter), named PREFIX_{val,train}_NNNNNN: shard 0 is the validation split and the
rest are training data, as in build-nanogpt. A schedule then reads them with
`data "shards/"`: training from the `train` shards, validation from the `val` one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256


def documents(text: str) -> Iterator[str]:
    """Paragraphs: the text between blank lines, stripped, never empty."""
    for block in text.split("\n\n"):
        if block.strip():
            yield block.strip()


def tokens_of(text: str) -> np.ndarray:
    """<|endoftext|> before every document, then its ids: build-nanogpt's `tokenize`."""
    from schedc.model.data import EOT_ID, gpt2_encoding

    enc = gpt2_encoding()
    ids: list[int] = []
    for doc in documents(text):
        ids.append(EOT_ID)
        ids.extend(enc.encode_ordinary(doc))
    return np.asarray(ids, dtype=np.uint16)


def write_shard(path: Path, tokens: np.ndarray, fmt: str) -> Path:
    if fmt == "npy":
        np.save(path.with_suffix(".npy"), tokens)
        return path.with_suffix(".npy")
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_MAGIC, LLMC_VERSION, len(tokens))
    out = path.with_suffix(".bin")
    with out.open("wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    return out


def make_shards(
    tokens: np.ndarray, out: Path, shard_tokens: int, prefix: str = "corpus", fmt: str = "npy"
) -> list[Path]:
    """Cut `tokens` into shards of `shard_tokens` in `out`: shard 0 'val', the rest 'train'."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        split = "val" if i == 0 else "train"
        name = out / f"{prefix}_{split}_{i:06d}"
        written.append(write_shard(name, tokens[start : start + shard_tokens], fmt))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True, type=Path, help="directory for the shards")
    ap.add_argument("--text", type=Path, help="a UTF-8 text file (default: the embedded corpus)")
    ap.add_argument("--shard-tokens", type=int, default=100_000, help="ids a shard (100,000)")
    ap.add_argument("--prefix", default=None, help="file name prefix (default: the text's name)")
    ap.add_argument("--format", choices=("npy", "bin"), default="npy")
    args = ap.parse_args(argv)
    if args.shard_tokens < 2:
        ap.error("--shard-tokens must be at least 2")
    if args.text is None:
        import gzip
        from importlib import resources

        blob = (resources.files("schedc") / "assets" / "corpus.txt.gz").read_bytes()
        text, prefix = gzip.decompress(blob).decode("utf-8"), "corpus"
    else:
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            ap.error(f"{args.text}: {e}")
        prefix = args.text.stem
    tokens = tokens_of(text)
    paths = make_shards(tokens, args.out, args.shard_tokens, args.prefix or prefix, args.format)
    print(f"{len(tokens):,} tokens in {len(paths)} shards in {args.out}: {paths[0].name} ..")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens for training: GPT-2's tokenizer, the token sources, and the global batch of a step.

Sources, as `DataConfig.source` names them:

    "corpus"        the embedded text (assets/corpus.txt.gz), tokenized once per process
    a text file     UTF-8, tokenized with GPT-2's BPE
    a token file    GPT-2 ids as uint16: nanoGPT's raw `.bin`, llm.c's `.bin` (1 KiB header),
                    or a build-nanogpt `.npy` shard; never read whole into memory

Nothing is downloaded: the BPE ranks ship in assets/gpt2.tiktoken, and
`tiktoken.get_encoding` (which fetches them from the network) is never called.

Which sequences a step, rank and micro-step see is fixed by `schedc.model.batching`;
`GlobalBatches` maps those global sequence ids onto the token stream.

A token file is opened as a memory map (`load_tokens`: its shape, at no cost), but
`GlobalBatches` reads it with pread, a batch's rows at a time (model/token_files.py): a
file cut short under a run is then a DataError naming it, where a page of a map past the
new end is SIGBUS. Ranks agree on a fingerprint of every byte they may read: sha256 over
the whole stream, in order, read once per machine for a large file (`TokenFile.scan`).
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import os
import stat
import weakref
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe

from schedc.files import NotRegularFile, file_kind, read_limited
from schedc.model.arch import GPT2_VOCAB
from schedc.model.batching import sequence_ids
from schedc.model.config import TOKEN_SUFFIXES, DataConfig, is_glob
from schedc.model.token_files import DataError, TokenFile, stream_hash

EOT = "<|endoftext|>"
EOT_ID = 50256
# tiktoken's r50k/gpt2 pre-tokenizer: contractions, letters, digits, punctuation, whitespace.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
# sha256 of assets/gpt2.tiktoken: tiktoken caches files by path, so a hash keeps a stale
# cached copy from standing in for the shipped one.
_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# llm.c's token files: 256 int32 header (magic, version, token count, ...), then uint16 ids.
_LLMC_MAGIC, _LLMC_HEADER_BYTES = 20240520, 1024

# A text source is read whole and tokenized in memory (the ids as Python ints on the way:
# about 36 bytes per token, 9 bytes per byte of text), so its size is bounded; a token file
# is read a batch at a time and has no limit.
MAX_TEXT_BYTES = 64 << 20
_OPEN_FILES = 8  # token files a GlobalBatches keeps open (a run reads them in order)

CORPUS = "corpus"
KINDS = ("auto", "text", "tokens")


# -- tokenizer ---------------------------------------------------------------------------


def _asset(name: str):
    # importlib.resources finds the file in a source checkout, a wheel or a zip alike.
    return resources.files("schedc") / "assets" / name


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2's byte-level BPE (50,257 ids; `<|endoftext|>` is 50256), from the shipped ranks."""
    with resources.as_file(_asset("gpt2.tiktoken")) as path:
        ranks = load_tiktoken_bpe(str(path), expected_hash=_BPE_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT: EOT_ID},
        explicit_n_vocab=GPT2_VOCAB,
    )


# -- token sources -----------------------------------------------------------------------


@functools.cache
def corpus_tokens() -> np.ndarray:
    """The embedded corpus as uint16 GPT-2 ids (read-only: it is shared by every caller).

    Tokenizing the 1.4 MB text takes about a tenth of a second, so there is no disk cache.
    """
    text = gzip.decompress(_asset("corpus.txt.gz").read_bytes()).decode("utf-8")
    tokens = np.asarray(gpt2_encoding().encode_ordinary(text), dtype=np.uint16)
    tokens.setflags(write=False)
    return tokens


def load_tokens(source: str | os.PathLike[str] = CORPUS, kind: str = "auto") -> np.ndarray:
    """A 1-D array of non-negative token ids from `source` (see the module docstring).

    `kind` is 'text', 'tokens', or 'auto': token files by suffix (.bin, .npy), else text.
    The name "corpus" means the embedded corpus; write "./corpus" for a file of that name.
    """
    if kind not in KINDS:
        raise ValueError(f"data kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if str(source) == CORPUS:
        return corpus_tokens()
    path = Path(source)
    if kind == "tokens" or (kind == "auto" and path.suffix.lower() in TOKEN_SUFFIXES):
        return _read_npy(path) if path.suffix.lower() == ".npy" else _read_bin(path)
    return _read_text(path)


def _file_size(path: Path) -> int:
    """Size in bytes of a readable, non-empty regular file, else a DataError."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: it is {file_kind(st.st_mode)}, not a regular file")
    size = st.st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    return size


def _read_text(path: Path) -> np.ndarray:
    # Read through read_limited, not read_bytes: a FIFO or a device is refused before a byte
    # is read (/dev/zero has st_size 0 and would fill memory), and the limit holds on the
    # bytes actually read.
    _file_size(path)
    try:
        data = read_limited(path, MAX_TEXT_BYTES)
    except NotRegularFile as e:
        raise DataError(f"{path}: {e.strerror}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_TEXT_BYTES:
        raise DataError(
            f"{path}: a text file is tokenized in memory, so it may be at most "
            f"{MAX_TEXT_BYTES >> 20} MiB; for a larger corpus write its GPT-2 ids to a .bin "
            "file of uint16 (memory-mapped, any size)"
        )
    hint = "; token files need a .bin or .npy suffix, or kind='tokens'"
    if b"\0" in data:  # valid UTF-8, but no text file holds NUL bytes: a binary file
        raise DataError(f"{path}: looks like a binary file (it holds NUL bytes), not text{hint}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}){hint}") from None
    tokens = np.asarray(gpt2_encoding().encode_ordinary(text), dtype=np.uint16)
    if tokens.size == 0:
        raise DataError(f"{path}: holds no text")
    return tokens


def _read_bin(path: Path) -> np.ndarray:
    """nanoGPT's raw little-endian uint16 ids, or llm.c's file with its 1 KiB header."""
    size = _file_size(path)
    offset = 0
    if size >= _LLMC_HEADER_BYTES:
        header = np.fromfile(path, dtype="<i4", count=3)
        # As raw GPT-2 ids the magic would read (55432, 308): 55432 is no GPT-2 token.
        if header[0] == _LLMC_MAGIC:
            version, count = int(header[1]), int(header[2])
            if version != 1:
                raise DataError(
                    f"{path}: llm.c token file version {version}; only 1 (GPT-2) is read"
                )
            if size != _LLMC_HEADER_BYTES + 2 * count:
                raise DataError(
                    f"{path}: corrupt llm.c token file: header says {count} tokens, "
                    f"but {size} bytes hold {(size - _LLMC_HEADER_BYTES) / 2:g}"
                )
            offset = _LLMC_HEADER_BYTES
    if (size - offset) % 2:
        raise DataError(
            f"{path}: corrupt token file: {size} bytes is not a whole number of uint16 tokens"
        )
    if size == offset:
        raise DataError(f"{path}: holds no tokens")
    return np.memmap(path, dtype="<u2", mode="r", offset=offset)


def _read_npy(path: Path) -> np.ndarray:
    """A build-nanogpt shard: a 1-D integer .npy array (uint16 as written there)."""
    _file_size(path)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: corrupt or not a .npy array ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"{path}: expected a 1-D integer array of token ids, "
            f"got shape {tokens.shape} of {tokens.dtype}"
        )
    if tokens.size == 0:
        raise DataError(f"{path}: holds no tokens")
    if np.issubdtype(tokens.dtype, np.signedinteger):
        if _extent(tokens, TokenFile.of(tokens, str(path)))[0] < 0:
            raise DataError(f"{path}: holds negative token ids")
    return tokens


def _extent(tokens: np.ndarray, f: TokenFile | None) -> tuple[int, int]:
    """The smallest and largest id: a token file's from its scan (read with pread, once)."""
    if f is None:
        return int(tokens.min()), int(tokens.max())
    _, lo, hi = f.scan()
    return lo, hi


# -- global batches ----------------------------------------------------------------------


class GlobalBatches:
    """The token stream cut into sequences, addressed by global sequence id.

    Global id g reads data sequence ``d = g mod num_seqs`` (the stream wraps at its end):
    ``x = tokens[d*T : (d+1)*T]`` and ``y = tokens[d*T+1 : (d+1)*T+1]``. Step s's global
    batch is ids ``s*S .. s*S + S - 1``; `micro_batch` gives a rank's slice of it as
    `schedc.model.batching.sequence_ids` assigns it. The position in the stream is the
    step, so a run resumed at step s reads what the run that was not stopped read.

    Several shards (arrays, each a token file's memory map or in memory) are one stream in
    their order: each holds ``(len - 1) // T`` sequences and none crosses into the next, as
    build-nanogpt's loader moves to the next shard when the rest of one cannot fill a batch
    row. A token file is read with pread (`TokenFile`), never through its map.

    Ids >= `vocab_size` are folded to ``id % vocab_size`` only for models whose vocabulary
    is smaller than GPT-2's (the tiny CPU sizes); for a full vocabulary they are an error,
    and a negative id always is: a single array is checked whole when it is opened, every
    row as a batch reads it, in the shard's own dtype (a uint64 id past 2**63 is no
    negative int64).
    """

    def __init__(
        self,
        tokens: np.ndarray | Sequence[np.ndarray],
        seq_len: int,
        global_seqs: int,
        vocab_size: int,
        *,
        origin: str | Sequence[str] = "tokens",
    ) -> None:
        if seq_len < 1 or global_seqs < 1 or vocab_size < 1:
            raise ValueError("seq_len, global_seqs and vocab_size must be positive")
        parts = list(tokens) if isinstance(tokens, (list, tuple)) else [tokens]
        if not parts or not all(isinstance(t, np.ndarray) for t in parts):
            parts = [np.asarray(tokens)]  # ids as a Python list: one stream
        shards: list[np.ndarray] = [np.asanyarray(t) for t in parts]  # a memmap stays one
        origins = [origin] if isinstance(origin, str) else list(origin)
        if len(origins) != len(shards):
            origins = [f"{origins[0]} (shard {i})" for i in range(len(shards))]
        for t, name in zip(shards, origins, strict=True):
            if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer):
                raise DataError(f"{name}: expected a 1-D integer array of token ids")
            if t.size < seq_len + 1:
                raise DataError(
                    f"{name}: {t.size} tokens are too few for one sequence of length "
                    f"{seq_len} (it needs {seq_len + 1}: the targets are shifted by one)"
                )
        full_vocab = vocab_size >= GPT2_VOCAB
        # a token file is read through its TokenFile, never through its map
        self._files = [TokenFile.of(t, name) for t, name in zip(shards, origins, strict=True)]
        self._open: dict[int, int] = {}  # shard: descriptor, the last _OPEN_FILES read
        weakref.finalize(self, _close_all, self._open)
        self._fingerprint: str | None = None
        self.full_vocab = full_vocab
        self.shards = shards
        self.origins = origins
        self.vocab_size = vocab_size
        if len(shards) == 1:
            self._check(0, *_extent(shards[0], self._files[0]))
        self.seq_len = seq_len
        self.global_seqs = global_seqs
        self.origin = origins[0] if len(origins) == 1 else f"{len(origins)} shards"
        counts = np.array([(t.size - 1) // seq_len for t in shards], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)])  # each shard's first sequence
        self.num_seqs = int(self._first[-1])
        """Distinct sequences in the stream; global ids wrap around modulo this."""
        self._fold = not full_vocab  # and the identity on ids inside the vocabulary

    def fold_note(self) -> str:
        """What the run says of the fold (a model below GPT-2's vocabulary; else nothing):
        it changes the tokens the model sees, so it is said, not only done."""
        if not self._fold:
            return ""
        return (
            f"token ids >= {self.vocab_size:,} are folded to id % {self.vocab_size:,} (the "
            f"model's vocabulary is smaller than GPT-2's {GPT2_VOCAB:,})"
        )

    @property
    def tokens(self) -> np.ndarray:
        """The stream of a single source (shards are not one array: see `shards`)."""
        (t,) = self.shards
        return t

    @property
    def tokens_per_step(self) -> int:
        return self.global_seqs * self.seq_len

    def fingerprint(self) -> str:
        """Every shard's content, every byte, in order: ranks (and a resumed run) must read
        the same stream in the same order, whatever the files are called. Computed once (the
        ranks agree on it, and each checkpoint records it): a full read of every token file,
        where no scan of it is kept (`TokenFile.scan`)."""
        if self._fingerprint is None:
            each = [
                f.scan()[0] if f is not None else fingerprint(t)
                for t, f in zip(self.shards, self._files, strict=True)
            ]
            if len(each) == 1:
                self._fingerprint = each[0]
            else:
                h = hashlib.sha256(b"shards")
                for one in each:
                    h.update(one.encode())
                self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def micro_batch(
        self, step: int, rank: int, micro: int, B: int, D: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 (B, T), that `rank` of `D` runs at micro-step `micro`."""
        return self._rows(sequence_ids(step, rank, micro, B, D, self.global_seqs))

    def rows(self, step: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 (n, T), of `positions` of the global batch of `step`
        (a bound plan's slice: ir/bound.py)."""
        first = step * self.global_seqs
        return self._rows(range(first + positions.start, first + positions.stop))

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 (S, T), of the whole global batch of `step`."""
        return self._rows(sequence_ids(step, 0, 0, self.global_seqs, 1, self.global_seqs))

    def _rows(self, ids: range) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        d = np.arange(ids.start, ids.stop, dtype=np.int64) % self.num_seqs  # data sequences
        shard = np.searchsorted(self._first, d, side="right") - 1
        rows = np.empty((len(d), T + 1), dtype=np.int64)
        for i in np.unique(shard):
            mine = shard == i
            got = self._read(int(i), d[mine] - self._first[i])  # each a sequence and its next
            self._check(int(i), int(got.min()), int(got.max()))
            if self._fold:  # in the file's dtype: uint64 ids past 2**63 are numbers still
                got = got % got.dtype.type(self.vocab_size)
            rows[mine] = got
        out = torch.from_numpy(rows)
        return out[:, :-1].contiguous(), out[:, 1:].contiguous()  # x, y: (n, T) each

    def _read(self, i: int, seqs: np.ndarray) -> np.ndarray:
        """Sequences `seqs` of shard i, each with the token after it: (n, T + 1), the
        shard's dtype. A token file is read with one pread per run of consecutive ones."""
        T = self.seq_len
        window = np.arange(T + 1)
        f = self._files[i]
        if f is None:
            return self.shards[i][seqs[:, None] * T + window]
        fd = self._descriptor(i, f)
        cuts = np.flatnonzero(np.diff(seqs) != 1) + 1
        parts = []
        for run in np.split(seqs, cuts):
            first, n = int(run[0]), len(run)
            span = f.read(fd, first * T, (first + n) * T + 1)
            parts.append(span[np.arange(n)[:, None] * T + window])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _descriptor(self, i: int, f: TokenFile) -> int:
        """Shard i's open descriptor: the last _OPEN_FILES shards read stay open (a run
        reads its shards in order; a thousand of them would not all fit the fd limit)."""
        fd = self._open.pop(i, None)
        if fd is None:
            fd = f.open()
            if len(self._open) >= _OPEN_FILES:
                os.close(self._open.pop(next(iter(self._open))))  # the least recently read
        self._open[i] = fd
        return fd

    def _check(self, i: int, lo: int, hi: int) -> None:
        """Ids of shard i as small as `lo` and as large as `hi`: none negative, and for a
        full vocabulary none outside it (a smaller one folds them)."""
        if lo < 0:
            raise DataError(f"{self.origins[i]}: holds negative token ids")
        if self.full_vocab and hi >= self.vocab_size:
            raise DataError(
                f"{self.origins[i]}: token id {hi} is outside the model's vocabulary of "
                f"{self.vocab_size}"
            )


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


SPLITS = ("train", "val")


def shard_files(source: str) -> list[Path]:
    """The token files one source names, in a deterministic order: a glob's matches and a
    directory's .npy/.bin files sorted by name (build-nanogpt's order), or the file itself."""
    path = Path(source)
    found: Iterable[Path]
    if is_glob(source):
        found, none = map(Path, glob.glob(source)), "matches no .npy or .bin token file"
    elif path.is_dir():
        found, none = path.iterdir(), "a directory without .npy or .bin token shards"
    else:
        return [path]
    files = sorted(f for f in found if f.suffix.lower() in TOKEN_SUFFIXES)
    if not files:
        raise DataError(f"{source}: {none}")
    return files


def split_of(path: Path) -> str:
    """build-nanogpt's rule, by file name: a shard whose name says 'val' is validation data
    (`edufineweb_val_000000.npy`); every other one is training data."""
    return "val" if "val" in path.name else "train"


def load_batches(
    data: DataConfig, seq_len: int, global_seqs: int, vocab_size: int, split: str = "train"
) -> GlobalBatches:
    """`GlobalBatches` over the source that `data` names: for token shards, those of `split`
    (one token file, a text file or the corpus is training data whatever its name)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not data.sharded:
        named = "the embedded corpus" if data.source == CORPUS else data.source
        if Path(data.source).is_dir():
            raise DataError(
                f'{named}: a directory; for the token shards in it write `data "{named}/"`'
            )
        if split == "val":
            raise DataError(
                f"{named}: validation reads the `val` shards, and one source has none: "
                'write `data "shards/"` (scripts/make_shards.py makes them)'
            )
        tokens = load_tokens(data.source, data.kind)
        return GlobalBatches(tokens, seq_len, global_seqs, vocab_size, origin=named)
    files = [f for s in data.sources for f in shard_files(s)]
    mine = [f for f in files if split_of(f) == split]
    if not mine:
        named = ", ".join(data.sources)
        raise DataError(f"{named}: no {split} shard (a shard whose name says 'val' is one)")
    if len(set(mine)) != len(mine):
        twice = next(f for f in mine if mine.count(f) > 1)
        raise DataError(f"{twice}: named by two data sources; it would be read twice a pass")
    arrays = [load_tokens(f, "tokens") for f in mine]
    return GlobalBatches(arrays, seq_len, global_seqs, vocab_size, origin=[str(f) for f in mine])


def fingerprint(tokens: np.ndarray) -> str:
    """A short hash of every token of an array, to prove every rank reads the same data:
    sha256 of the count, then the ids as stored (as it always was up to 4M tokens, which
    keeps a checkpoint's record of such data valid). A token file's memory map is read with
    pread (`TokenFile.scan`), never through the map."""
    f = TokenFile.of(tokens)
    if f is not None:
        return f.scan()[0]
    h = stream_hash(len(tokens))
    h.update(np.ascontiguousarray(tokens))
    return h.hexdigest()[:16]

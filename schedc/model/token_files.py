"""Token files read with pread, not through a memory map, and hashed whole; and DataError,
which every reader of data raises (model/data.py re-exports it).

A token file that `load_tokens` mapped is read here a batch's rows at a time: a file cut
short under a run is a DataError naming it, where a page of the map past the new end is
SIGBUS, and another file renamed over it is refused (the ranks agreed on the first).

Ranks agree on a fingerprint of every byte they may read: sha256 of the count, then every
id as stored (`TokenFile.scan`: about 1 GB/s of one core, 0.2 s for 100M tokens in the
page cache; sha256 alone is 1.2 GB/s, the rest is the reads and the smallest and largest
id, found in the same pass). It is read once per process while the file's times stay the
same, and a file of CACHED_BYTES or more keeps it on disk (`_cache_path`), so a run over
the shards of the last run reads none of them at start-up.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np

from schedc.errors import UserError

# A token file this large (32M tokens) has its fingerprint kept on disk: hashing it costs a
# tenth of a second or more; a smaller one is hashed again at each start (which keeps test
# runs from filling the cache with files that no longer exist).
CACHED_BYTES = 64 << 20
_SCAN_BYTES = 16 << 20  # read and hashed this much at a time


class DataError(UserError):
    """A data source that cannot be used; the message starts with the file it is about."""


class TokenFile:
    """The ids of a token file that `load_tokens` mapped, read with pread instead of
    through the map: a file cut short under the run is a DataError naming it, not SIGBUS.

    `scan()` reads it all once, for its fingerprint and its smallest and largest id; a file
    of CACHED_BYTES or more keeps them on disk between runs (`_cache_path`).
    """

    def __init__(self, name: str, path: str, offset: int, dtype: np.dtype, count: int):
        self.name, self.path, self.offset, self.dtype, self.count = name, path, offset, dtype, count
        self.nbytes = count * dtype.itemsize
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(f"{name}: cannot read it ({e.strerror})") from None
        self.identity = (st.st_dev, st.st_ino)  # the file the map was made of (or near)

    @staticmethod
    def of(tokens: np.ndarray, name: str | None = None) -> TokenFile | None:
        """The file behind a memory map `load_tokens` made (np.memmap or np.load's, whole,
        its buffer the map itself); None for an array in memory or a view of a map, whose
        offset into the file np.memmap does not track."""
        if not isinstance(tokens, np.memmap) or not isinstance(tokens.base, mmap.mmap):
            return None
        if tokens.filename is None or not tokens.flags.c_contiguous or tokens.ndim != 1:
            return None
        path = str(tokens.filename)
        return TokenFile(name or path, path, tokens.offset, tokens.dtype, tokens.size)

    def open(self) -> int:
        """A descriptor of the file this reader was made for: one that another file has
        replaced under its name since (same name, another inode) is refused."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise DataError(f"{self.name}: cannot read it ({e.strerror})") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise DataError(
                f"{self.name}: replaced by another file since the run opened it; the ranks "
                "agreed on the tokens of the first"
            )
        return fd

    def read(self, fd: int, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop) of the file, as its dtype."""
        size = self.dtype.itemsize
        want, at = (stop - start) * size, self.offset + start * size
        parts, got = [], 0
        while got < want:
            try:
                part = os.pread(fd, want - got, at + got)
            except OSError as e:
                raise DataError(f"{self.name}: cannot read it ({e.strerror})") from None
            if not part:
                now = os.fstat(fd).st_size
                raise DataError(
                    f"{self.name}: shorter than when the run opened it ({now:,} bytes, it "
                    f"was {self.offset + self.nbytes:,}): cut short under the run; the token "
                    f"at {(at + got - self.offset) // size:,} is gone"
                )
            parts.append(part)
            got += len(part)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return np.frombuffer(data, dtype=self.dtype)

    def scan(self) -> tuple[str, int, int]:
        """(fingerprint, smallest id, largest id) of every token: read once per process
        while the file's times stay the same, and once per machine where it is large."""
        fd = self.open()
        try:
            before = os.fstat(fd)
            where = (self.offset, self.dtype.str, self.count)
            key = (os.path.realpath(self.path), *_times(before), *where)
            if (hit := _SCANS.get(key)) is not None:
                return hit
            cache = _cache_path(key) if before.st_size >= CACHED_BYTES else None
            if cache is not None and (hit := _cached(cache)):
                return _SCANS.setdefault(key, hit)
            h = stream_hash(self.count)
            lo, hi = None, None
            for start in range(0, self.count, _SCAN_BYTES // self.dtype.itemsize):
                stop = min(self.count, start + _SCAN_BYTES // self.dtype.itemsize)
                part = self.read(fd, start, stop)
                h.update(part)
                a, b = int(part.min()), int(part.max())
                lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if _times(before) != _times(after):
            raise DataError(f"{self.name}: changed while it was read for its fingerprint")
        assert lo is not None and hi is not None
        found = _SCANS[key] = (h.hexdigest()[:16], lo, hi)
        # not kept for a file written in the last seconds: a write still to come in the same
        # tick of the file system's clock would leave its times as they are (racy git's rule)
        if cache is not None and time.time() - max(after.st_mtime, after.st_ctime) > 2:
            _keep(cache, found)
        return found


_SCANS: dict[tuple, tuple[str, int, int]] = {}  # this process's scans, by _cache_path's key


def stream_hash(count: int):
    """The fingerprint's hash before the ids: their count (old checkpoints recorded it so)."""
    return hashlib.sha256(str(count).encode())


def _times(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _cache_path(key: tuple) -> Path:
    """Where a token file's scan is kept between runs, named by its key: the file's real
    path, device, inode, size, modification and change times (the ctime no program sets:
    every write moves it) and the region of ids read. $SCHEDC_CACHE_DIR, else the user's
    cache directory."""
    root = os.environ.get("SCHEDC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "schedc"
    )
    name = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    return Path(root) / "fingerprints" / name


def _cached(path: Path) -> tuple[str, int, int] | None:
    try:
        v = json.loads(path.read_text())
        found = (v["sha256"], v["min"], v["max"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none kept, or not one schedc wrote: scanned again
    ok = isinstance(found[0], str) and len(found[0]) == 16
    return found if ok and all(type(x) is int for x in found[1:]) else None


def _keep(path: Path, found: tuple[str, int, int]) -> None:
    """Written whole or not at all (ranks on one machine write the same entry at once); a
    cache that cannot be written costs the next run a scan, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(dict(zip(("sha256", "min", "max"), found, strict=True))))
        os.replace(tmp, path)
    except OSError:
        pass

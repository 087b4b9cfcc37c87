"""Reading a checkpoint's files without trusting them: which checkpoint `latest` names,
and every file opened as a regular file only (never a link, FIFO or device), read up to a
bound or hashed in full, refused by size before a byte is read."""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
from pathlib import Path

from schedc.exec.checkpoint.layout import STEP_DIR, CheckpointError


def mac(key: bytes, data: bytes) -> str:
    """meta.json.hmac's text: the HMAC-SHA256 of meta.json's bytes under the key."""
    return "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()


def open_regular(path: Path) -> int:
    """A descriptor of `path` if it is a regular file. O_NOFOLLOW refuses a symbolic link,
    O_NONBLOCK keeps the open of a FIFO from waiting for a writer, fstat refuses the rest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(
                f"{path}: a symbolic link; a checkpoint holds regular files only"
            ) from None
        raise CheckpointError(f"{path}: cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or directory)")
    return fd


def read_bounded(path: Path, limit: int, what: str = "a checkpoint file") -> bytes:
    """A regular file's bytes, refused when there are more than `limit` of them."""
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{path}: over {limit} bytes, too large for {what}")
    return data


def hash_file(path: Path, limit: int | None = None) -> tuple[str, int]:
    """SHA-256 and size of a regular file (never a link, FIFO or device), refused before
    a byte is read when it is larger than `limit` (a sparse file costs nothing to make)."""
    fd = open_regular(path)
    size = os.fstat(fd).st_size
    if limit is not None and size > limit:
        os.close(fd)
        raise CheckpointError(
            f"{path}: {size} bytes, more than the {limit} a checkpoint of this model can hold"
        )
    h, n = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                n += len(block)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    return h.hexdigest(), n


def find(root: str | os.PathLike) -> Path:
    """The checkpoint to resume from: `root` itself, or the one `root/latest` names, which
    must be a directory step_NNNNNNNN directly inside `root` (no path, no link out of it)."""
    root = Path(root)
    if (root / "meta.json").exists():
        return root
    latest = root / "latest"
    if not os.path.lexists(latest):
        if not root.exists():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        raise CheckpointError(f"{root}: no complete checkpoint here (no 'latest' file)")
    try:
        name = read_bounded(latest, 64, "'latest'").decode("ascii").strip()
    except UnicodeDecodeError:
        name = "?"
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(
            f"{latest}: names {name[:40]!r}, not a checkpoint step_NNNNNNNN of this directory"
        )
    path = root / name
    if path.is_symlink() or not path.is_dir() or path.resolve().parent != root.resolve():
        raise CheckpointError(
            f"{latest}: names {path}, which is not a directory inside {root}"
            " (a symbolic link, or missing)"
        )
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path}: named by {latest} but incomplete (no meta.json)")
    return path


def read_key(path: str | os.PathLike) -> bytes:
    """The secret of --checkpoint-key FILE: the file's bytes (16 to 4096 of them)."""
    key = read_bounded(Path(path), 4096, "a checkpoint key")
    if len(key) < 16:
        raise CheckpointError(
            f"{path}: a checkpoint key needs at least 16 bytes, this has "
            f"{len(key)} (e.g. head -c 32 /dev/urandom > {path})"
        )
    return key

"""Reading files safely: regular files only, never more than a limit.

The schedule reader (lang/read.py) and the data loader (model/data.py) both read through
`read_limited`, and the HellaSwag reader a line at a time through `open_regular`, so a FIFO,
a device or /dev/zero named by mistake is refused before a byte is read, and a size limit
holds on the bytes actually read. The bottom of the package: it imports nothing of schedc.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO


class NotRegularFile(OSError):
    """A path that names a directory, FIFO, device or socket: nothing schedc reads."""

    def __init__(self, path: str | os.PathLike[str], mode: int):
        self.kind = file_kind(mode)
        super().__init__(f"it is {self.kind}, not a regular file")
        self.strerror = str(self)
        self.filename = str(path)


def file_kind(mode: int) -> str:
    """What a st_mode names, as a message says it."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


# O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one (the
# fstat below then refuses it); on a regular file the flag changes nothing. O_NOCTTY: a
# terminal device named by mistake never becomes the controlling terminal.
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def read_limited(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit + 1` of them.

    A result longer than `limit` means the file is over the limit: the limit holds on the
    bytes actually read, not on st_size, which is 0 for /dev/zero, a FIFO or a /proc file.
    Anything but a regular file raises NotRegularFile before a byte is read (`open_regular`).
    Other failures raise the OSError of the call that failed.
    """
    with open_regular(path) as f:
        return f.read(limit + 1)  # a buffered read loops until limit + 1 bytes or EOF


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """The regular file `path` opened for reading in binary, for a reader that reads it a
    piece at a time (and bounds each piece itself).

    Anything but a regular file raises NotRegularFile before a byte is read; the type is
    taken with fstat of the open descriptor, so a path swapped for a FIFO or a device after
    the first look is still caught (the stat before opening only spares devices an open).
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, mode)
    fd = os.open(path, _OPEN_FLAGS)
    f = os.fdopen(fd, "rb", closefd=True)  # owns fd: closing f closes it
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
    except BaseException:
        f.close()
        raise
    return f

"""Reading a schedule: a file's bytes -> Source, or a diagnostic saying why not.

Regular files only, at most MAX_SOURCE_BYTES read (schedc/files.py); UTF-8 text with no NUL;
a byte-order mark dropped and CRLF or a lone CR made LF once, here, so line numbers, columns
and excerpts all count the same way.
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path

from schedc.files import read_limited
from schedc.ir.source import Source
from schedc.lang.diagnostics import CompileError, Diagnostic

MAX_SOURCE_BYTES = 1 << 20  # a schedule is a page of text; anything larger is a mistake


def read_source(path: str | Path) -> Source:
    """A schedule file as a Source; a CompileError for unreadable, binary or oversized input."""
    try:
        data = read_limited(path, MAX_SOURCE_BYTES)
    except OSError as e:
        raise CompileError(
            [Diagnostic("io", f"cannot read file: {e.strerror or e}", path=str(path))]
        ) from None
    if len(data) > MAX_SOURCE_BYTES:
        try:  # the size for the message only: the limit held on the bytes read
            size = os.stat(path).st_size
        except OSError:
            size = 0
        limit = f"{MAX_SOURCE_BYTES:,}"
        said = f"{size:,} bytes" if size > MAX_SOURCE_BYTES else f"over {limit} bytes"
        raise CompileError(
            [
                Diagnostic(
                    "file-too-large",
                    f"file is {said}; a schedule is at most {limit}",
                    hint="a .sched file describes one training step in a page of text",
                    path=str(path),
                )
            ]
        )
    return source_from_bytes(data, str(path))


def source_from_bytes(data: bytes, path: str = "<input>") -> Source:
    """Bytes as schedule text: UTF-8, a byte-order mark dropped, every line end made LF."""
    if len(data) > MAX_SOURCE_BYTES:
        raise CompileError(
            [
                Diagnostic(
                    "file-too-large",
                    f"input is {len(data):,} bytes; a schedule is at most {MAX_SOURCE_BYTES:,}",
                    path=path,
                )
            ]
        )
    # A byte-order mark is no part of the text: dropped, it moves no column. Offsets in
    # messages about bytes still count it, as a hex dump of the file would.
    skipped = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = _newlines(data[skipped:].decode("utf-8"))
    except UnicodeDecodeError as e:
        good = _newlines(data[skipped : skipped + e.start].decode("utf-8"))
        bad = skipped + e.start
        # the excerpt shows the bad byte's line to its end, each undecodable byte as U+FFFD
        end = data.find(b"\n", bad)
        rest = data[bad : end if end >= 0 else len(data)].decode("utf-8", errors="replace")
        src = Source(path, good + _newlines(rest))
        raise CompileError(
            [
                Diagnostic(
                    "encoding",
                    f"byte 0x{data[bad]:02x} at offset {bad} is not UTF-8 text",
                    span=src.span_at(len(good)),
                    hint="a .sched file is UTF-8 text; is this a binary file?",
                    path=path,
                )
            ],
            src,
        ) from None
    nul = text.find("\x00")
    if nul >= 0:
        src = Source(path, text)
        raise CompileError(
            [
                Diagnostic(
                    "encoding",
                    "NUL byte in source",
                    span=src.span_at(nul),
                    hint="a .sched file is UTF-8 text; is this a binary file?",
                    path=path,
                )
            ],
            src,
        ) from None
    return Source(path, text)


def source_from_text(text: str, path: str = "<input>") -> Source:
    return source_from_bytes(text.encode("utf-8"), path)


def _newlines(text: str) -> str:
    """CRLF (Windows) and a lone CR (classic Mac OS) both end a line: made "\\n" once, here,
    so that line numbers, columns and the lines an excerpt prints all count the same way."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text

"""Live heap on a CPU: the counterpart of `torch.cuda.max_memory_allocated`.

glibc's `mallinfo2` says how many bytes malloc has handed out and not taken back (arena
chunks in use plus mmapped chunks); torch's CPU allocator takes every tensor from malloc,
so the difference between two readings is what the step allocated, without the pages the
allocator keeps cached that RSS also counts. A peak inside one op (a gradient that lives
for a few kernels) is caught by a thread that reads it every millisecond; readings between
the ops of the plan are exact. Where glibc is absent (macOS, musl) `heap_bytes` is None
and nothing is measured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int | None:
    """Bytes malloc has handed out and not taken back (heap + mmapped chunks), or None."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return m.uordblks + m.hblkhd


class HeapPeak:
    """The highest live heap seen while the block runs: read every `every_s` by a thread,
    and whenever `sample()` is called (between ops)."""

    def __init__(self, every_s: float = 0.001):
        self.every_s = every_s
        self.start = self.peak = heap_bytes() or 0

    def sample(self) -> None:
        now = heap_bytes()
        if now is not None and now > self.peak:
            self.peak = now

    def __enter__(self) -> HeapPeak:
        self.start = self.peak = heap_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join()
        self.sample()
        return False

    @property
    def grew(self) -> int:
        """The most the heap grew above where it was when the block began."""
        return self.peak - self.start

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
import gc
import os
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


# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
# what a user sets to tune glibc's malloc themselves (or another allocator, preloaded)
_USER_MALLOC = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Have glibc keep the memory torch frees for its next allocation, instead of handing
    it back to the kernel; call it before the model exists. True if it took effect.

    By default each chunk over the mmap threshold (128 KiB, rising to 32 MiB) is a mapping
    of its own: freeing it unmaps it, and the next tensor of that size faults in and zeroes
    every page again, in the kernel, on the rank's only core. A training step frees and
    allocates the same sizes every micro-step (activations, logits, gradient buffers), so
    kept memory is reused as it is. Measured on mini at world 2 (docs/benchmarks.md):
    2.35 million page faults and 6.7 s of kernel time in 10 steps by default, 0.60 million
    and 3.0 s kept (mostly start-up); the median step went from 1.13-1.16 s to 0.92-0.97 s.
    The live heap (`heap_bytes`) is unchanged: it counts in-use bytes either way. Left
    alone where the user tunes malloc (`_USER_MALLOC`) or there is no glibc."""
    if any(os.environ.get(k) for k in _USER_MALLOC):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # no chunk gets a mapping of its own, and the heap's free top is never trimmed
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


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
        # no garbage collection inside the block: a cycle of an earlier step's tensors freed
        # mid-step would lower the heap under `start` and hide what the step itself grew
        self._collecting = gc.isenabled()
        gc.disable()
        self.start = self.peak = heap_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        if self._collecting:
            gc.enable()

    @property
    def grew(self) -> int:
        """The most the heap grew above where it was when the block began."""
        return self.peak - self.start

"""The process heap's peak above where a block began, on CPU: what benchmarks compare to the planner's memory of a
stage on top of the states (``ALLOCATOR_PEAK_ENV=1``; on CUDA the allocator's own peak is used instead).

glibc's ``mallinfo2`` counts every byte malloc has handed out and not taken back, in every arena and mapped
block, whichever thread frees it; a sampling thread keeps the largest value seen. The torch profiler's memory
record, used here before, misses frees made on other threads (gloo's workers drop the buffers of collectives), so
its running sum only grew: with sequence parallelism it put a 3-micro-batch update 0.2-0.3 GiB above the truth.

    with HeapPeak() as peak:
        ...
    peak.above_bytes      # the most held above the start while the block ran
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

ALLOCATOR_PEAK_ENV = "PREFIX_GRPO_ALLOCATOR_PEAK"  # benchmarks on CPU: "1" records each stage's heap peak


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (arenas and mapped blocks), over every thread."""
    if _MALLINFO2 is None:
        raise RuntimeError(f"{ALLOCATOR_PEAK_ENV}=1 measures the heap with glibc's mallinfo2 (Linux, glibc 2.33 or "
                           "newer), which this C library lacks")
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


class HeapPeak:
    """The largest ``heap_bytes()`` seen while the block runs (sampled every ``interval`` seconds, and at both
    ends), minus its value at the start."""

    def __init__(self, interval: float = 2e-4):
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, heap_bytes())

    def __enter__(self) -> HeapPeak:
        self.start = self.peak = heap_bytes()
        self._thread = threading.Thread(target=self._sample, name="heap-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int:
        """Ends the sampling (once); the bytes above the start."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, heap_bytes())
        return self.above_bytes

    @property
    def above_bytes(self) -> int:
        return max(0, self.peak - self.start)


def heap_peak(device) -> HeapPeak | None:
    """A started ``HeapPeak`` when ``device`` is the CPU and ``ALLOCATOR_PEAK_ENV`` is "1" (a benchmark's switch);
    else None. The caller ends it with ``stop()``."""
    if torch.device(device).type != "cpu" or os.environ.get(ALLOCATOR_PEAK_ENV) != "1":
        return None
    return HeapPeak().__enter__()

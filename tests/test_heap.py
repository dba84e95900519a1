"""The CPU heap peak that benchmarks set beside the planner (``app.runtime.heap``)."""

from __future__ import annotations

import threading
import time

import torch

from app.runtime.heap import HeapPeak, heap_peak


def test_heap_peak_sees_what_the_block_held_and_frees_made_on_other_threads():
    with HeapPeak() as peak:
        x = torch.ones(2**24)  # 64 MiB
        y = x * 2  # 128 MiB held together
        del x, y
    assert 128 <= peak.above_bytes / 2**20 < 136
    box = []
    with HeapPeak() as peak:  # a tensor made here and dropped by another thread, five times: 4 MiB at most
        for _ in range(5):
            box.append(torch.ones(2**20))
            # held long enough for the sampler to see it: under a loaded machine's scheduling a tensor dropped at
            # once can go unsampled (a run of the whole suite saw 3.96 MiB)
            time.sleep(0.05)
            worker = threading.Thread(target=box.clear)
            worker.start()
            worker.join()
    # one 4 MiB tensor at a time: the profiler's record summed them to 20 MiB (its frees unseen). The heap around them
    # moves too: a make test run saw 4,153,376 bytes above the start, the tensor less 40 KB the interpreter freed
    # meanwhile, so the lower bound is most of one tensor, not all of it to the byte
    assert 0.95 * 4 <= peak.above_bytes / 2**20 < 8


def test_heap_peak_is_a_cpu_benchmark_switch(monkeypatch):
    monkeypatch.delenv("PREFIX_GRPO_ALLOCATOR_PEAK", raising=False)
    assert heap_peak("cpu") is None
    monkeypatch.setenv("PREFIX_GRPO_ALLOCATOR_PEAK", "1")
    assert heap_peak("meta") is None
    record = heap_peak("cpu")
    assert record.stop() >= 0

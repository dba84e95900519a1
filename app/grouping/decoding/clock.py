"""Where a rollout's time goes (``PartClock``): wall seconds per named part, taken lap by lap. On CUDA each lap is
an event on the current stream, read once at the end (no host sync inside the decode loop: what is timed is what the
device did between two laps, host gaps included in the lap that follows them); elsewhere ``time.perf_counter``. The
vision tower is carved out of the prefill by hooks on its module (``tower_hooks``).

Also the card's nominal memory bandwidth by name (``nominal_bandwidth``), for a decode step's bytes against it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PARTS = ("gather", "tower", "prefill", "capture", "decode", "sampling")
BANDWIDTH_TB_S = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35, "A100-SXM4-80GB": 2.04,
                  "A100 80GB PCIe": 1.94, "A100": 1.56, "L40S": 0.864, "A10G": 0.6}  # nominal, vendors' sheets


def nominal_bandwidth(device) -> float | None:
    """The card's nominal memory bandwidth in TB/s by its name (``BANDWIDTH_TB_S``), or None (CPU, unknown)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    for key, value in BANDWIDTH_TB_S.items():  # the most specific names first
        if key in name:
            return value
    return None


class PartClock:
    """Seconds per part of one rollout: ``lap(name)`` gives the time since the previous lap to ``name``;
    ``seconds()`` reads them all (on CUDA: one synchronisation). ``count(name)`` counts events (decode steps)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.laps: list[tuple[str, object]] = []
        self.counts: dict[str, int] = defaultdict(int)
        self.extra: dict[str, float] = defaultdict(float)  # seconds measured apart (the tower inside the prefill)
        self.start()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.laps.append(("", self._now()))

    def lap(self, name: str) -> None:
        self.laps.append((name, self._now()))

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def seconds(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for (_, before), (name, after) in zip(self.laps, self.laps[1:]):
            if name:
                out[name] += (before.elapsed_time(after) / 1e3) if self.cuda else after - before
        for name, value in self.extra.items():
            out[name] += value
        return dict(out)

    @contextmanager
    def tower_hooks(self, model, carve_from: str = "prefill"):
        """While inside, the vision tower's calls are timed as ``tower`` (and taken out of ``carve_from``), and the
        patch rows they read counted (``counts["tower_patches"]``)."""
        from app.grouping.modules import unwrap

        visual = getattr(getattr(unwrap(model), "model", None), "visual", None)
        if visual is None:
            yield
            return
        begun = []

        def before(module, args):
            if self.cuda:
                torch.cuda.synchronize()
            if not begun and args:  # the outermost call: the patch rows this rollout's tower pass reads
                self.counts["tower_patches"] += int(args[0].shape[0])
            begun.append(time.perf_counter())

        def after(module, args, output):
            if self.cuda:
                torch.cuda.synchronize()
            spent = time.perf_counter() - begun.pop()
            self.extra["tower"] += spent
            self.extra[carve_from] -= spent

        handles = [visual.register_forward_pre_hook(before), visual.register_forward_hook(after)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

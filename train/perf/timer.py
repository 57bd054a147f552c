"""Device-synchronised step timing and percentiles."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import numpy as np
import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued device work. On CUDA this is a host-device sync point; on CPU a no-op."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """``with Timed(device) as t: work()`` then ``t.ms`` (milliseconds) and ``t.start``/``t.end``
    (``time.perf_counter()`` seconds): the duration between two synchronised clock readings, so queued
    device work is inside it. On CUDA both ends are host-device sync points (benchmarks, not the loop)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.device, self.clock = device, clock
        self.start = self.end = 0.0
        self.ms = float("nan")

    def __enter__(self) -> "Timed":
        synchronize(self.device)
        self.start = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        self.end = self.clock()
        self.ms = (self.end - self.start) * 1e3


def percentiles(values: Iterable[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, Optional[float]]:
    """``{"p50": …, "p90": …, "p99": …}`` with numpy's default (linear) interpolation; None when empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


class StepTimer:
    """Times steps as durations between synchronised clock readings (``time.perf_counter``).

    The first step (cold: allocator warm-up, lazy init, compilation) is kept apart from the
    steady-state steps that percentiles and throughput use.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first_ms: Optional[float] = None
        self.steady_ms: list[float] = []
        self._t0: Optional[float] = None

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """End the step; returns its duration in milliseconds."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() without start()")
        synchronize(self.device)
        ms = (time.perf_counter() - self._t0) * 1e3
        self._t0 = None
        if self.first_ms is None:
            self.first_ms = ms
        else:
            self.steady_ms.append(ms)
        return ms

    def summary(self) -> dict[str, Optional[float]]:
        return percentiles(self.steady_ms)

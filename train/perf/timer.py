"""Step timing (``StepTimer``: no per-step sync; ``Timed``: synchronised, for benchmarks) and percentiles."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

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
    """Times training steps without a host-device sync per step.

    CPU: durations between ``time.perf_counter()`` readings (CPU work is synchronous, nothing to wait for).
    CUDA: a pair of timing events is recorded into the stream around each step; their durations are read
    by :meth:`flush` (one wait on the newest event, a sync point) — the trainer does that once per logged
    step. ``stop(resolve=True)`` reads one step at once (for callers that need every duration: profilers).

    The first step (cold: allocator warm-up, lazy init, compilation) is kept apart (``first_ms``) from the
    steady-state steps (``steady_ms``, milliseconds) that percentiles and throughput use; both are filled as
    durations become known.

    Args:
        device: where the step's work runs.
        event_factory: makes a timing event (``record()``, ``synchronize()``, ``elapsed_time(end) -> ms``);
            default ``torch.cuda.Event(enable_timing=True)`` on CUDA, None (host clock) elsewhere. Tests inject
            a fake to exercise the event path on a CPU.
        clock: the host clock in seconds (``time.perf_counter``).
    """

    def __init__(self, device: torch.device, event_factory: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device, self.clock = device, clock
        if event_factory is None and device.type == "cuda":
            event_factory = functools.partial(torch.cuda.Event, enable_timing=True)
        self.event_factory = event_factory
        self.first_ms: Optional[float] = None
        self.steady_ms: list[float] = []
        self._t0: Any = None
        self._pending: list[tuple[Any, Any]] = []  # (start, end) events not read yet, oldest first
        self._ready: list[float] = []  # durations known but not yet returned by flush()

    @property
    def uses_events(self) -> bool:
        return self.event_factory is not None

    @property
    def pending(self) -> int:
        """Steps stopped whose durations are not read yet (always 0 with the host clock)."""
        return len(self._pending)

    def start(self) -> None:
        if self.event_factory is None:
            self._t0 = self.clock()
        else:
            self._t0 = self.event_factory()
            self._t0.record()

    def stop(self, resolve: bool = False) -> Optional[float]:
        """End the step. Returns its duration in milliseconds when known: always with the host clock; with
        events only if ``resolve`` (which waits for the device: a sync point), else None (read by :meth:`flush`).

        Raises:
            RuntimeError: without a matching :meth:`start`.
        """
        if self._t0 is None:
            raise RuntimeError("StepTimer.stop() without start()")
        t0, self._t0 = self._t0, None
        if self.event_factory is None:
            self._add(float((self.clock() - t0) * 1e3))
            return self._ready[-1]
        end = self.event_factory()
        end.record()
        self._pending.append((t0, end))
        if not resolve:
            return None
        self._read_events()
        return self._ready[-1]

    def flush(self) -> list[float]:
        """Durations (ms) of every step stopped since the last flush, oldest first (also the ones ``stop``
        returned). With events still unread: one wait on the newest end event (a host-device sync), then reads."""
        self._read_events()
        out, self._ready = self._ready, []
        return out

    def _read_events(self) -> None:
        if not self._pending:
            return
        self._pending[-1][1].synchronize()  # the stream is in order: every earlier event has completed too
        for start, end in self._pending:
            self._add(float(start.elapsed_time(end)))
        self._pending.clear()

    def _add(self, ms: float) -> None:
        self._ready.append(ms)
        if self.first_ms is None:
            self.first_ms = ms
        else:
            self.steady_ms.append(ms)

    def summary(self) -> dict[str, Optional[float]]:
        """Percentiles (ms, see :func:`percentiles`) of the steady steps; reads unread events first."""
        self._read_events()
        return percentiles(self.steady_ms)

"""The one clock of ``make optimize``: a :class:`Deadline` made at the command's start (``t_start``, taken by
``python -m train`` before torch is imported) that every phase asks — data preparation and set-up have already spent
their share when the search starts; the profiles, each A/B (before it starts, and before every round of timed
windows), the final confirmation and the output writing ask what is left. ``optimize.budget_s`` is the deadline of
the whole command; ``optimize.arm_timeout_s`` one A/B's, never later than the command's
(:meth:`Deadline.within`); the final confirmation's time is held back from the A/Bs only once a lever is kept
(:meth:`Deadline.less`).

A call inside a C kernel cannot be interrupted (a signal waits for it to return), so the bound is kept by not
*starting* work that would not end in time — a timed window, a round, an A/B, a profile — from estimates of measured
times (:class:`CostModel`). What cannot be split (one window, one build, the outputs' writing) may run past the
deadline: the command ends within ``budget_s`` + :func:`overshoot_allowed` (docs/optimize.md, "The budget").

Every reason of the form ``budget: …`` is written by :func:`budget_reason`, which is also the check: it returns None
when the work fits, so no reason can claim a shortage that is not one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional


class OutOfTime(Exception):
    """Work stopped between two of its steps because the deadline passed; the message is its
    :func:`budget_reason`."""


def overshoot_allowed(budget_s: float) -> float:
    """How far past ``budget_s`` the command may end: max(10 % of it, 30 s) — the window, build or write in progress
    when the deadline passes, and the estimates' error."""
    return max(0.1 * budget_s, 30.0)


class Deadline:
    """``budget_s`` seconds from ``start`` on ``clock`` (``time.perf_counter`` by default: ``python -m train``'s
    ``t_start``; a test passes a fake clock). ``limit`` names the setting that set it (said in reasons); ``reserved``
    and ``reserved_for``: the seconds held back before the parent's end and what for (:meth:`less`)."""

    def __init__(self, budget_s: float, *, start: Optional[float] = None,
                 clock: Callable[[], float] = time.perf_counter, limit: str = "optimize.budget_s",
                 end: Optional[float] = None, reserved: float = 0.0, reserved_for: str = "") -> None:
        self.clock = clock
        self.start = clock() if start is None else start
        self.budget_s = budget_s
        self.end = self.start + budget_s if end is None else end
        self.limit = limit
        self.reserved, self.reserved_for = reserved, reserved_for

    def elapsed(self) -> float:
        """Seconds since ``start``."""
        return self.clock() - self.start

    def remaining(self) -> float:
        """Seconds left before the end (negative once passed)."""
        return self.end - self.clock()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def fits(self, seconds: float) -> bool:
        """True when work of ``seconds`` started now ends by the deadline."""
        return seconds <= self.remaining()

    def within(self, seconds: float, limit: str) -> "Deadline":
        """A deadline ``seconds`` from now (a per-A/B limit, named ``limit``), never later than this one's."""
        now = self.clock()
        if now + seconds < self.end:
            return Deadline(seconds, start=now, clock=self.clock, limit=limit)
        return Deadline(self.budget_s, start=self.start, clock=self.clock, limit=self.limit, end=self.end,
                        reserved=self.reserved, reserved_for=self.reserved_for)

    def less(self, seconds: float, reserved_for: str) -> "Deadline":
        """This deadline ``seconds`` earlier, holding them for ``reserved_for`` (0: the same end)."""
        seconds = max(0.0, seconds)
        return Deadline(self.budget_s, start=self.start, clock=self.clock, limit=self.limit,
                        end=self.end - seconds, reserved=self.reserved + seconds,
                        reserved_for=reserved_for if seconds else self.reserved_for)

    def describe(self) -> str:
        """``optimize.budget_s=120`` (or the limit that set this deadline)."""
        return f"{self.limit}={self.budget_s:g}"


def budget_reason(deadline: Deadline, what: str, need_s: float) -> Optional[str]:
    """None when ``what`` (``"its A/B"``, ``"a re-profile"``…), estimated at ``need_s`` seconds, fits ``deadline``;
    else why not, in one line that adds up: ``budget: its A/B needs ~28 s and ~35 s are held for the final
    confirmation of what was kept; 57 s left of optimize.budget_s=180`` (28 + 35 > 57). Seconds needed are rounded
    up and seconds left down, so the words never contradict the figures; once the command's time is gone, it says
    so."""
    if deadline.fits(need_s):
        return None
    held = deadline.reserved
    left = deadline.remaining() + held  # what the command has left; ``held`` of it is not this work's
    if left <= 0:
        return (f"budget: {what} not started: {deadline.describe()} has passed ({deadline.elapsed():.0f} s since "
                "the start)")
    words = f"budget: {what} needs ~{math.ceil(need_s)} s"
    if held > 0:
        words += f" and ~{math.ceil(held)} s are held for {deadline.reserved_for}"
    return words + f"; {math.floor(left)} s left of {deadline.describe()}"


@dataclass
class CostModel:
    """Measured times the estimates are made of: seconds per training sample of each settings (from timed windows,
    else from a profile), the fixed seconds of an A/B (builds, quality reads: what is not training steps) and of a
    profile, and the output writing."""

    per_sample: dict[tuple, float] = field(default_factory=dict)
    fixed: list[float] = field(default_factory=list)
    profile_s: list[float] = field(default_factory=list)
    build_s: list[float] = field(default_factory=list)
    quality_s: list[float] = field(default_factory=list)
    write_s: float = 0.0

    def fixed_s(self) -> float:
        """The typical fixed seconds of an A/B (two builds, quality reads); before any A/B, two builds as the last
        profile's (its wall time less its steps'; else the whole profile's)."""
        if self.fixed:
            return sorted(self.fixed)[len(self.fixed) // 2]
        if self.build_s:
            return 2 * self.build_s[-1]
        return 2 * self.profile_s[-1] if self.profile_s else 0.0

    def pair_s(self, a: tuple, b: tuple, samples: int, b_speedup: float = 1.0) -> Optional[float]:
        """An A/B of settings ``a`` and ``b`` that trains each ``samples`` (warm-up and windows): the fixed seconds
        plus both arms' samples at their measured speeds (``b`` not measured yet: ``a``'s × ``b_speedup``, its
        predicted speed-up, taken within [0.5, 4]); neither speed known: the fixed seconds alone; nothing measured
        at all: None."""
        sa, sb = self.per_sample.get(a), self.per_sample.get(b)
        sa = sb if sa is None else sa
        sb = sa / min(4.0, max(0.5, b_speedup)) if sb is None and sa is not None else sb
        if sa is None or sb is None:
            return self.fixed_s() if self.fixed or self.profile_s else None
        return self.fixed_s() + samples * (sa + sb)

    def learn(self, timings: dict[str, Any], keys: dict[str, tuple]) -> None:
        """What an :class:`~train.optimize.arms.ArmSet` measured (:meth:`ArmSet.timings`): each arm's
        seconds per sample, keyed by its settings (``keys``: arm name → settings key), and the fixed seconds."""
        for name, key in keys.items():
            sps = timings["per_sample"].get(name)
            if sps:
                self.per_sample[key] = sps
        if timings.get("fixed_s") is not None:
            self.fixed.append(timings["fixed_s"])
        if timings.get("quality_s") is not None:
            self.quality_s.append(timings["quality_s"])

    def quality_read_s(self, key: tuple, held_out: int) -> float:
        """One quality read of settings ``key``: as measured (the median read), else ``held_out`` samples' forward
        passes at a third of a training sample's seconds (forward ≈ a third of forward + backward + optimizer)."""
        if self.quality_s:
            return sorted(self.quality_s)[len(self.quality_s) // 2]
        return held_out * self.per_sample.get(key, 0.0) / 3

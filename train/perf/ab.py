"""The one A/B measurement: named arms, warmed up, timed in interleaved windows, compared by paired ratios.

Every comparison of speed in this project goes through :func:`interleave` — each benchmark row, the regression
gate, ``bench-vs-hf``, the ``auto`` probes (precision, batching, packed attention) and ``make optimize``:

1. **warm-up**: each arm runs ``warmup`` untimed steps (compilation, allocator, caches), in turn;
2. **rounds**: ``rounds`` rounds, each running every arm for one timed window (``window`` steps, or until the
   window has seen ``window_samples`` samples); the order rotates by one arm per round, so no arm always runs
   first and a machine whose speed drifts slows every arm alike;
3. **timing**: each window is timed between two device synchronisations (:class:`~train.perf.timer.Timed`), so
   queued GPU work is inside it; an arm may report its own ``seconds`` instead (a whole training run timed over
   its steady steps);
4. **statistics**: per arm the median over windows of each rate (``samples`` per second, or ``steps`` per
   second); per pair the per-round ratios of the two arms' rates (each round's two windows ran back to back), their
   median and a percentile-bootstrap confidence interval of that median (Efron & Tibshirani, *An Introduction to
   the Bootstrap*, 1993, ch. 13; resampling rounds, seeded). An interval that includes 1.0 is "no measurable
   difference", never a win. The 1-minute load average at the start and end says how busy the machine was.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from train.perf.timer import Timed

CONFIDENCE = 0.95
"""The confidence level of every ratio interval."""
BOOTSTRAP_RESAMPLES = 2000


@dataclass
class Arm:
    """One side of a comparison.

    ``step()`` runs one unit of work and returns what it did as numbers that add up over a window (e.g.
    ``{"samples": 32, "real_tokens": 900}``; None counts only the step). A returned ``seconds`` replaces the
    window's synchronised wall time with the arm's own (its sum over the window). ``measure`` (optional) makes a
    context manager entered around each timed window that yields a dict the arm fills on exit (energy, peak
    memory, step times); it lands in :attr:`Window.extra`. ``warmup`` replaces :func:`interleave`'s for this arm;
    ``rounds`` (when set) limits the arm to the first that many rounds (a short, timing-only arm).
    """

    name: str
    step: Callable[[], Optional[Mapping[str, float]]]
    measure: Optional[Callable[[], contextlib.AbstractContextManager[dict]]] = None
    warmup: Optional[int] = None
    rounds: Optional[int] = None


@dataclass
class Window:
    """One timed window of one arm: ``round`` (0-based), ``seconds``, ``steps`` and the summed ``counts``."""

    round: int
    seconds: float
    steps: int
    counts: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    def rate(self, metric: str = "samples") -> Optional[float]:
        """``metric`` per second in this window (``steps`` counts steps); None without time or without the count."""
        n = self.steps if metric == "steps" else self.counts.get(metric)
        return n / self.seconds if n is not None and self.seconds > 0 else None


@dataclass
class ArmResult:
    """An arm's windows in round order."""

    name: str
    windows: list[Window]

    def rates(self, metric: str = "samples") -> list[float]:
        return [r for w in self.windows if (r := w.rate(metric)) is not None]

    def median(self, metric: str = "samples") -> Optional[float]:
        """Median over windows of ``metric`` per second; None when no window measured it."""
        rates = self.rates(metric)
        return float(np.median(rates)) if rates else None

    def median_step_ms(self) -> Optional[float]:
        """Median over windows of milliseconds per step."""
        ms = [1e3 * w.seconds / w.steps for w in self.windows if w.steps]
        return float(np.median(ms)) if ms else None

    def total(self, key: str) -> float:
        """``key`` summed over every timed window (``steps`` and ``seconds`` too)."""
        if key in ("steps", "seconds"):
            return sum(getattr(w, key) for w in self.windows)
        return sum(w.counts.get(key, 0) for w in self.windows)


@dataclass
class Ratio:
    """``a`` ÷ ``b`` in ``metric`` per second: ``per_round`` ratios, their ``median`` and its ``confidence``
    interval [``low``, ``high``]. ``verdict``: ``faster`` / ``slower`` when the interval excludes 1.0, ``no
    measurable difference`` when it includes 1.0, ``one round: no interval`` with a single round."""

    a: str
    b: str
    metric: str
    per_round: list[float]
    median: Optional[float]
    low: Optional[float]
    high: Optional[float]
    confidence: float = CONFIDENCE

    @property
    def verdict(self) -> str:
        if self.median is None:
            return "not measured"
        if self.low is None:
            return "one round: no interval"
        if self.low > 1.0:
            return "faster"
        if self.high is not None and self.high < 1.0:
            return "slower"
        return "no measurable difference"

    def clears(self, min_gain: float) -> bool:
        """True when the interval's lower bound is at least ``min_gain`` (e.g. 1.02: a gain of 2 % or more)."""
        return self.low is not None and self.low >= min_gain

    def describe(self) -> str:
        """``1.23x [1.10, 1.31] (faster)`` — the ratio in words, its noise included."""
        if self.median is None:
            return "not measured"
        if self.low is None:
            return f"{self.median:.2f}x ({self.verdict})"
        return f"{self.median:.2f}x [{self.low:.2f}, {self.high:.2f}] ({self.verdict})"

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "metric": self.metric, "median": self.median, "low": self.low,
                "high": self.high, "confidence": self.confidence, "per_round": self.per_round, "verdict": self.verdict}


def bootstrap_interval(values: Sequence[float], confidence: float = CONFIDENCE,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[Optional[float], Optional[float]]:
    """Percentile-bootstrap interval of the median of ``values`` (resampled with replacement, seeded: the same
    values give the same interval). ``(None, None)`` for fewer than two values: one round has no measurable noise,
    so it supports no claim."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if arr.size < 2:
        return None, None
    rng = np.random.default_rng(seed)
    medians = np.median(arr[rng.integers(0, arr.size, size=(resamples, arr.size))], axis=1)
    tail = 100 * (1 - confidence) / 2
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


@dataclass
class ABResult:
    """What :func:`interleave` measured: each arm's windows, the rounds, and the machine's load around it."""

    arms: dict[str, ArmResult]
    rounds: int
    load_start: Optional[float]
    load_end: Optional[float]

    def ratio(self, a: str, b: str, metric: str = "samples") -> Ratio:
        """``a``'s rate ÷ ``b``'s, paired round by round (see the module docstring)."""
        ra = {w.round: w.rate(metric) for w in self.arms[a].windows}
        rb = {w.round: w.rate(metric) for w in self.arms[b].windows}
        per_round = [ra[r] / rb[r] for r in sorted(ra) if ra[r] and rb.get(r)]
        low, high = bootstrap_interval(per_round)
        return Ratio(a, b, metric, per_round, float(np.median(per_round)) if per_round else None, low, high)

    def as_dict(self, metric: str = "samples") -> dict[str, Any]:
        return {"rounds": self.rounds, "load_1min_start": self.load_start, "load_1min_end": self.load_end,
                "arms": {n: {"median_per_s": r.median(metric), "median_step_ms": r.median_step_ms(),
                             "windows": [{"round": w.round, "seconds": w.seconds, "steps": w.steps, **w.counts}
                                         for w in r.windows]} for n, r in self.arms.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ABResult":
        """The result :meth:`as_dict` wrote (windows' counts and times; a window's ``extra`` is not kept).

        Raises:
            KeyError, TypeError, ValueError: ``d`` is not what :meth:`as_dict` writes.
        """
        fixed = ("round", "seconds", "steps")
        arms = {n: ArmResult(n, [Window(int(w["round"]), float(w["seconds"]), int(w["steps"]),
                                        {k: float(v) for k, v in w.items() if k not in fixed})
                                 for w in a["windows"]]) for n, a in d["arms"].items()}
        return cls(arms, int(d["rounds"]), d.get("load_1min_start"), d.get("load_1min_end"))


def load_1min() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _window(arm: Arm, rnd: int, steps: Optional[int], samples: Optional[int], device: torch.device) -> Window:
    counts: dict[str, float] = {}
    n = 0
    with contextlib.ExitStack() as stack:
        extra = stack.enter_context(arm.measure()) if arm.measure is not None else {}
        with Timed(device) as t:
            while (n < steps) if steps is not None else (counts.get("samples", 0) < samples or n == 0):
                for k, v in (arm.step() or {}).items():
                    counts[k] = counts.get(k, 0) + v
                n += 1
    seconds = counts.pop("seconds", None)
    return Window(rnd, t.ms / 1e3 if seconds is None else float(seconds), n, counts, dict(extra))


def interleave(arms: Sequence[Arm], *, rounds: int, device: torch.device, window: Optional[int] = 1,
               window_samples: Optional[int] = None, warmup: int = 1,
               on_round: Optional[Callable[[int], None]] = None) -> ABResult:
    """Measure ``arms`` side by side (module docstring). ``window``: steps per timed window, or ``window_samples``:
    steps until the window has seen that many samples (``window`` is then ignored). ``on_round(r)`` after each
    round (progress). Exceptions from an arm propagate (a caller that must survive one catches and records it).

    Raises:
        ValueError: no arms, duplicate names, ``rounds`` < 1, or neither a positive ``window`` nor ``window_samples``.
    """
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"arms need distinct names (got {names})")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    steps = None if window_samples else window
    if not (steps and steps > 0) and not (window_samples and window_samples > 0):
        raise ValueError("a window needs window >= 1 steps or window_samples >= 1")
    load_start = load_1min()
    for arm in arms:
        for _ in range(warmup if arm.warmup is None else arm.warmup):
            arm.step()
    out = {a.name: ArmResult(a.name, []) for a in arms}
    for r in range(rounds):
        active = [a for a in arms if a.rounds is None or r < a.rounds]
        k = r % len(active) if active else 0
        for arm in active[k:] + active[:k]:
            out[arm.name].windows.append(_window(arm, r, steps, window_samples, device))
        if on_round is not None:
            on_round(r)
    return ABResult(out, rounds, load_start, load_1min())

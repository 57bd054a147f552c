"""One A/B of ``make optimize``: two arms built, warmed to the same samples, interleaved, their quality read — and, for
a candidate on other steps per sample, trained on to the planned run's horizon (:func:`horizon_target`) and read
again. Used by the search (search.py) and its final confirmation; :func:`window_for` also sizes the grid's final."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from train.optimize.arms import ArmSet
from train.optimize.deadline import Deadline
from train.perf.ab import ABResult

MIN_ROUNDS = 2
"""The fewest timed rounds that give an interval: an A/B is started only when this many fit the deadline, and one
cut short before its quality read is read where it stopped only once it has them."""


@dataclass
class PairMeasurement:
    """What :func:`measure_pair` measured: the A/B, the candidate's one-off warm-up seconds, both arms' quality after
    :meth:`SearchSettings.quality_samples_seen` samples, and ``horizon`` — ``{"samples": n, <name>: quality, ...}``
    after both trained on untimed to ``n`` samples — or None."""

    result: ABResult
    warmup_s: float
    quality_best: dict
    quality_candidate: dict
    horizon: Optional[dict] = None
    cut_short: Optional[str] = None
    """Why the deadline ended the A/B early (fewer timed rounds, or no training on to the horizon); None: it ran as
    planned."""
    timings: dict = dataclasses.field(default_factory=dict)
    """What :meth:`ArmSet.timings` measured (seconds per sample per arm, the fixed seconds): later estimates."""


def window_for(backend: Any, settings: Any, at_least: int, steps: int, at_most: Optional[int] = None) -> int:
    """Samples per timed window for an A/B of ``settings`` (a sequence of override dicts): ``steps`` optimizer steps
    of the one with the most samples per step (``backend.samples_per_step``, where it has one), ``at_most``
    samples at the most (None: no cap) and ``at_least`` samples at the least: a window of a few steps times
    whichever buckets came up (docs/optimize.md, "The loop", step 4)."""
    per_step = getattr(backend, "samples_per_step", None)
    most = max(((per_step(x) or 0.0) for x in settings), default=0.0) if per_step else 0.0
    want = math.ceil(steps * most)
    return max(at_least, min(want, at_most) if at_most else want)


def quality_point(s: Any, rounds: int, window: int) -> tuple[int, int]:
    """``(warm-up samples, timed rounds before the quality read)`` so that the quality is read after
    :meth:`SearchSettings.quality_samples_seen` samples, whatever the window: the warm-up is at least
    ``s.window_samples`` and takes what whole windows leave (384-sample windows: 384 and 5 rounds; 2,176: 2,304 and
    0 — read right after the warm-up)."""
    want = s.quality_samples_seen()
    before = min(rounds, max(0, (want - s.window_samples) // window))
    return max(s.window_samples, want - before * window), before


def measure_pair(backend: Any, best: dict, cand: dict, s: Any, rounds: int,
                 names: tuple[str, str] = ("best", "candidate"),
                 extend: Callable[[ABResult], bool] = lambda _r: False,
                 horizon: Callable[[ABResult, dict[str, int]], Optional[int]] = lambda _r, _seen: None,
                 passing: Optional[int] = None, settled: Callable[[dict], bool] = lambda _h: False,
                 deadline: Optional[Deadline] = None,
                 hold: Optional[Callable[[ABResult], Optional[Deadline]]] = None,
                 quality_read_s: float = 0.0) -> PairMeasurement:
    """Build both arms, warm them untimed to the same samples seen, interleave ``rounds`` windows of
    :func:`window_for` samples (``s.window_steps`` steps of the arm with the most samples per step,
    ``s.max_window_samples`` at the most, ``s.window_samples`` at the least), read both quality figures when both
    arms have seen :meth:`SearchSettings.quality_samples_seen` samples (:func:`quality_point`: between two rounds,
    or after the warm-up), and interleave ``rounds`` more, up to ``s.max_extensions`` times, while ``extend(result
    so far)`` says the interval is still undecided; then, when ``horizon(result, samples seen per arm)`` names a
    sample count, train both arms on, untimed, to it and read both qualities again. ``passing``: a planned run
    shorter than the A/B itself — both qualities are read at the first round boundary where both arms have seen at
    least that many samples, and that read is the ``horizon`` (``note`` says where) unless ``horizon()`` names a
    later one; when ``settled(that read)`` (the search: the candidate fails the quality guard there, so no speed
    makes it a keeper) the A/B is not extended. ``deadline``: no window starts unless the rest of its round fits it,
    leaving room for both quality reads (``quality_read_s`` each, until one is timed), and training on to the horizon
    stops when it passes (:class:`ArmSet`, which asks ``hold`` after every round for an earlier one; a warm-up it
    stops raises :class:`~train.optimize.deadline.OutOfTime`); ``cut_short`` then says so — the result
    holds the rounds completed, the quality read where they stopped (none with fewer than :data:`MIN_ROUNDS`).
    Exceptions propagate (the caller records them); both arms are closed either way."""
    window = window_for(backend, (best, cand), s.window_samples, getattr(s, "window_steps", 0),
                        getattr(s, "max_window_samples", None))
    warm_samples, before = quality_point(s, rounds, window)
    quality: list[dict] = []
    passed: dict[str, Any] = {}
    with ArmSet(backend, backend.device, deadline, hold) as arms:
        # the rounds leave room for both quality reads (timed once one is done, else ``quality_read_s``)
        arms.tail = lambda: 0.0 if quality else 2 * (max(arms.quality_s) if arms.quality_s else quality_read_s)
        def read(r: int = -1) -> None:
            if r == before - 1 and not quality:
                quality.extend(arms.quality(n) for n in names)
            at = min(arms.seen.values())
            if passing and not passed and at >= passing:
                passed.update({"samples": at, "note": f"the first read past the planned run's {passing} samples: "
                               f"the A/B itself trains further"}, **{n: arms.quality(n) for n in names})

        arms.build(names[0], best)
        arms.build(names[1], cand)
        arms.warm(names[0], warm_samples)
        warm = arms.warm(names[1], warm_samples)
        read()
        result = arms.interleave(rounds, window, on_round=read)
        if not quality and result.rounds >= MIN_ROUNDS:  # cut short before the read: both arms where they stopped
            quality.extend(arms.quality(n) for n in names)
        q_best, q_cand = quality or ({}, {})
        for _ in range(s.max_extensions):
            if arms.stopped or not extend(result) or (passed and settled(passed)):
                break
            more = arms.interleave(rounds, window, on_round=read)
            for name, arm in more.arms.items():
                result.arms[name].windows += [dataclasses.replace(w, round=w.round + result.rounds)
                                              for w in arm.windows]
            result = ABResult(result.arms, result.rounds + more.rounds, result.load_start, more.load_end)
        out = PairMeasurement(result, warm, q_best, q_cand, horizon=passed or None)
        if arms.stopped:
            out.cut_short = f"cut short after {result.rounds} timed round(s): {arms.stopped}"
        target = None if arms.stopped else horizon(result, dict(arms.seen))
        if target:
            if all(arms.train_to(n, target) for n in names):
                out.horizon = {"samples": target, **{n: arms.quality(n) for n in names}}
            else:
                out.cut_short = f"not trained on to the horizon's {target} samples: {arms.stopped}"
    out.timings = arms.timings()
    return out


def horizon_target(result: ABResult, seen: dict[str, int], want: Optional[int], available_s: float,
                   min_extra: int) -> tuple[Optional[int], str]:
    """How far both arms train on for a horizon verdict: ``want`` samples, or fewer where training both to it at
    their A/B speeds (median samples/s) would not fit ``available_s``; None (with the reason) when nothing is
    wanted, when the arms are there already, or when less than ``min_extra`` more samples fit."""
    if not want:
        return None, "no planned run length to judge at"
    at = max(seen.values())
    if want <= at:
        return None, f"the arms have seen {at} samples, the horizon's {want}"
    rates = [result.arms[n].median("samples") for n in seen]
    if not all(rates):
        return None, "no measured speed to plan the horizon's training by"
    per_sample_s = sum(1.0 / r for r in rates)  # both arms train the same samples, one after the other
    fit = at + int(max(0.0, available_s) / per_sample_s)
    if fit < at + min_extra:
        return None, f"the horizon's {want} samples did not fit the time left ({available_s:.0f} s)"
    return (want, "") if fit >= want else (fit, f"{fit} of the planned {want} samples: what fit the time left")

"""One candidate's A/B against the current best, judged: the :class:`Backend` the search measures with, the pair
measured within its deadline (cut short when the budget runs out), and the verdict (faster by ``optimize.min_gain``
at the interval's low end, learning as well at the planned run's length)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from train.optimize.arms import ArmHandle, failure_reason, time_limit
from train.optimize.deadline import CostModel, Deadline
from train.optimize.judging import amortise, guard_verdict, quality_verdict, throughput_metric
from train.optimize.pairs import (
    MIN_ROUNDS,
    PairMeasurement,
    horizon_target,
    measure_pair,
    quality_point,
    window_for,
)
from train.optimize.proposals import EXACT, Candidate, Evidence, LeverContext
from train.optimize.results import Decision
from train.optimize.settings import SearchSettings
from train.perf.ab import ABResult


class Backend(Protocol):
    device: torch.device

    def context(self, settings: dict[str, Any]) -> LeverContext: ...
    def profile(self, settings: dict[str, Any], index: int) -> Evidence: ...
    def arm(self, name: str, settings: dict[str, Any]) -> ArmHandle: ...
    def schedule(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The step-counted settings and learning rate ``settings`` need to train on the config's schedule in samples
        (``optimize.lr_scaling``); {} when they already do."""
        ...

    # optional: ``samples_per_step(settings) -> float | None``, the samples per optimizer step of ``settings`` on the
    # data (:func:`with_schedule` reads it to find a candidate on other steps per sample)


def try_candidate(backend: Backend, best: dict, c: Candidate, s: SearchSettings, planned_s: Optional[float],
                  deadline: Deadline, costs: Optional[CostModel] = None,
                  confirm_from: Optional[dict] = None) -> Decision:
    """A/B ``c`` against the current ``best`` (module docstring); never raises but KeyboardInterrupt. ``deadline``:
    the search's, less what is held for the final confirmation — the A/B's own is the earlier of it and
    ``optimize.arm_timeout_s`` from now; no window starts past it (:func:`measure_pair`), and an undecided A/B is
    extended only while three times its time so far fits. ``costs`` learns the A/B's measured times.
    ``confirm_from``: nothing is kept yet, so nothing is held for the final confirmation; once ``c``'s interval
    clears ``optimize.min_gain`` (after :data:`MIN_ROUNDS` rounds) the confirmation of ``confirm_from`` (the
    baseline) against ``c`` would follow, so its estimate is held from then on."""
    clock = deadline.clock
    t0, left_s = clock(), deadline.remaining()
    own = deadline.within(s.arm_timeout_s, "optimize.arm_timeout_s")
    cand = {**best, **c.overrides}

    def hold(part: ABResult) -> Optional[Deadline]:
        if confirm_from is None or costs is None or part.rounds < MIN_ROUNDS:
            return None
        metric = throughput_metric(part)
        if not part.ratio("candidate", "best", metric).clears(s.min_gain):
            return None
        for name, settings in (("best", best), ("candidate", cand)):  # measured so far: the estimate's speeds
            arm = part.arms[name]
            if arm.total("samples"):
                costs.per_sample[settings_key(settings)] = arm.total("seconds") / arm.total("samples")
        need = (confirm_estimate(backend, confirm_from, cand, s, costs) or 0.0) + costs.write_s
        held = deadline.less(need, f"the final confirmation of {c.lever}={c.value}, which clears "
                                   f"optimize.min_gain={s.min_gain:g} so far")
        return held if held.end < own.end else None

    def undecided(result: ABResult) -> bool:
        r = result.ratio("candidate", "best", throughput_metric(result))
        spent = clock() - t0
        return (r.low is not None and r.median is not None and r.low < s.min_gain <= r.median
                and spent < s.arm_timeout_s / 3 and 3 * spent < left_s)

    changes_steps = (c.other_steps or "train.max_steps" in c.overrides) and c.may_change != EXACT
    horizon_note: list[str] = []

    def horizon(result: ABResult, seen: dict[str, int]) -> Optional[int]:
        r = result.ratio("candidate", "best", throughput_metric(result))
        if not changes_steps or r.low is None or r.low < s.min_gain:  # only a candidate fast enough to keep
            return None
        spent = clock() - t0
        target, why = horizon_target(result, seen, s.horizon_samples,
                                     min(0.8 * s.arm_timeout_s - spent, own.remaining() / 2), s.window_samples)
        horizon_note.append(why)
        return target

    def fails_guard(h: dict) -> Optional[str]:  # why, at the planned run's length: rejected however fast it is
        ok, why = quality_verdict(h["best"], h["candidate"], s.quality_tolerance)
        return None if ok or c.may_change == EXACT else why

    try:
        with time_limit(s.arm_timeout_s):
            m = measure_pair(backend, best, cand, s, s.rounds, extend=undecided, horizon=horizon,
                             passing=s.horizon_samples if changes_steps else None, settled=fails_guard,
                             deadline=own, hold=hold,
                             quality_read_s=(costs.quality_read_s(settings_key(best), s.quality_samples)
                                             if costs else 0.0))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # any failure of an arm is a rejected candidate, never a lost search
        return Decision(c, False, failure_reason(exc), seconds=clock() - t0)
    if costs is not None and m.timings:
        costs.learn(m.timings, {"best": settings_key(best), "candidate": settings_key(cand)})
    steady = m.result.ratio("candidate", "best", throughput_metric(m.result))
    ratio = amortise(steady, m.warmup_s, planned_s) if c.warmup_s_estimate or m.warmup_s > 1.0 else steady.as_dict()
    d = Decision(c, False, "", ratio=ratio, steady_ratio=steady.as_dict(), warmup_s=m.warmup_s or None,
                 seconds=clock() - t0)
    early = horizon_note[-1] if changes_steps and horizon_note else None
    d = judge(d, m, s, early, fails_guard)
    if m.cut_short:
        d.reason += f" ({m.cut_short})"
    return d


def judge(d: Decision, m: PairMeasurement, s: SearchSettings, early: Optional[str],
          fails_guard: Callable[[dict], Optional[str]]) -> Decision:
    """``d`` (its ratio set) accepted or rejected, with the reason: its interval's lower bound against
    ``optimize.min_gain``, then the quality guard — at the planned run's horizon when ``m`` read there (``early``:
    why it did not, for a candidate on other steps per sample)."""
    c, ratio, h = d.candidate, d.ratio, m.horizon
    d.quality = quality = {"best": m.quality_best, "candidate": m.quality_candidate}
    if h is not None:  # fewer, larger steps: judged where the planned run ends, not early in training
        quality["horizon"] = h
    low = ratio["low"]
    if low is None:
        d.reason = "no interval" if m.cut_short else "one round: no interval"  # cut short: try_candidate says why
        return d
    if low < s.min_gain:
        d.reason = (f"{ratio['median']:.3f}x [{low:.3f}, {ratio['high']:.3f}]: the interval's lower bound is below "
                    f"optimize.min_gain={s.min_gain:g}" + (" (no measurable difference)" if low <= 1 <= ratio["high"]
                                                           else ""))
        why = fails_guard(h) if h is not None else None
        d.reason += f"; the quality guard fails too, at {h['samples']} samples: {why}" if why else ""
        return d
    if c.may_change != EXACT:
        note = (h.get("note") or early or "the planned run") if h else ""
        ok, why = guard_verdict((m.quality_best, m.quality_candidate), s.quality_tolerance,
                                late=(h["best"], h["candidate"]) if h else None, samples=h and h["samples"], note=note)
        why += f" (early: {early})" if h is None and early is not None else ""
        quality["verdict"] = why
        if not ok:
            d.reason = f"quality guard: {why}"
            return d
    else:
        quality["verdict"] = "exact lever: the same computation, no quality check needed"
    d.accepted = True
    d.reason = f"{ratio['median']:.3f}x [{low:.3f}, {ratio['high']:.3f}] clears {s.min_gain:g}; {quality['verdict']}"
    return d


def pair_estimate(backend: Backend, best: dict, c: Candidate, s: SearchSettings, costs: CostModel,
                  rounds: int) -> Optional[float]:
    """The seconds of an A/B of ``c`` against ``best`` with ``rounds`` timed rounds (:meth:`CostModel.pair_s`: the
    fixed seconds, then both arms' warm-up and windows at their measured speeds, ``c``'s at its prediction until
    timed); None before anything was timed."""
    cand = {**best, **c.overrides}
    window = window_for(backend, (best, cand), s.window_samples, s.window_steps, s.max_window_samples)
    warm, _before = quality_point(s, s.rounds, window)
    got = costs.pair_s(settings_key(best), settings_key(cand), warm + rounds * window, c.predicted)
    return None if got is None else got + (0.0 if costs.fixed else 2 * costs.quality_read_s(settings_key(best),
                                                                                            s.quality_samples))


def confirm_estimate(backend: Backend, baseline: dict, best: dict, s: SearchSettings, costs: CostModel,
                     rounds: Optional[int] = None) -> Optional[float]:
    """The seconds of the final confirmation (``rounds``, default ``s.confirm_rounds``, windows of
    ``s.window_samples``: :func:`confirm`) at both settings' measured seconds per sample."""
    rounds = s.confirm_rounds if rounds is None else rounds
    window = s.window_samples
    warm, _before = quality_point(s, s.confirm_rounds, window)
    got = costs.pair_s(settings_key(baseline), settings_key(best), warm + rounds * window)
    return None if got is None else got + (0.0 if costs.fixed else 2 * costs.quality_read_s(settings_key(baseline),
                                                                                            s.quality_samples))


def settings_key(settings: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))

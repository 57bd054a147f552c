"""The progressive search of ``make optimize``: profile → rank the catalogue → A/B the most promising candidate
against the current best → keep it only when its interval clears ``optimize.min_gain`` and the quality guard passes
→ re-profile (the bottleneck moves) → repeat, until the budget or the candidates run out; then confirm baseline vs
optimized in one interleaved run.

The search is written against a :class:`Backend` (build an arm from settings, profile settings, say what levers may
look at), so a test drives it with fake arms of known speed, and ``make optimize`` with real training runs
(backend.py). Every arm failure — out of memory, an exception, a hang past ``optimize.arm_timeout_s`` — is a rejected
candidate with its reason (arms.py); the search goes on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from train.commands.optimize.arms import ArmHandle, failure_reason, time_limit
from train.commands.optimize.judging import amortise, guard_verdict, learned_worse, quality_verdict, throughput_metric
from train.commands.optimize.pairs import PairMeasurement, horizon_target, measure_pair
from train.commands.optimize.proposals import EXACT, Candidate, Evidence, Lever, LeverContext
from train.commands.optimize.results import Decision, SearchResult
from train.commands.optimize.settings import NO_GAIN, SearchSettings
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


def try_candidate(backend: Backend, best: dict, c: Candidate, s: SearchSettings,
                  planned_s: Optional[float], clock: Callable[[], float], left_s: float = math.inf) -> Decision:
    """A/B ``c`` against the current ``best`` (module docstring); never raises but KeyboardInterrupt. ``left_s``:
    what is left of the budget (an undecided A/B is extended only while three times its time so far fits)."""
    t0 = clock()
    cand = {**best, **c.overrides}

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
                                     min(0.8 * s.arm_timeout_s - spent, (left_s - spent) / 2), s.window_samples)
        horizon_note.append(why)
        return target

    def fails_guard(h: dict) -> Optional[str]:  # why, at the planned run's length: rejected however fast it is
        ok, why = quality_verdict(h["best"], h["candidate"], s.quality_tolerance)
        return None if ok or c.may_change == EXACT else why

    try:
        with time_limit(s.arm_timeout_s):
            m = measure_pair(backend, best, cand, s, s.rounds, extend=undecided, horizon=horizon,
                             passing=s.horizon_samples if changes_steps else None, settled=fails_guard)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # any failure of an arm is a rejected candidate, never a lost search
        return Decision(c, False, failure_reason(exc), seconds=clock() - t0)
    steady = m.result.ratio("candidate", "best", throughput_metric(m.result))
    ratio = amortise(steady, m.warmup_s, planned_s) if c.warmup_s_estimate or m.warmup_s > 1.0 else steady.as_dict()
    d = Decision(c, False, "", ratio=ratio, steady_ratio=steady.as_dict(), warmup_s=m.warmup_s or None,
                 seconds=clock() - t0)
    early = horizon_note[-1] if changes_steps and horizon_note else None
    return judge(d, m, s, early, fails_guard)


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
        d.reason = "one round: no interval"
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


def with_schedule(backend: Backend, ctx: LeverContext, best: dict[str, Any], c: Candidate) -> Candidate:
    """``c`` with the schedule overrides its samples per step need (:meth:`Backend.schedule`), said in its evidence;
    ``other_steps`` set when its samples per optimizer step differ from ``best``'s by more than 2 % (the backend's
    ``samples_per_step``, where it has one) — also when the config counts its run in epochs, where no step-counted
    setting changes."""
    cand = {**best, **c.overrides}
    per_step = getattr(backend, "samples_per_step", None)
    if per_step is not None and not c.other_steps:
        now, then = per_step(best), per_step(cand)
        if now and then and abs(then / now - 1) > 0.02:
            c = dataclasses.replace(c, other_steps=True)
    extra = {k: v for k, v in backend.schedule(cand).items() if k not in c.overrides}
    if not extra:
        return c

    words = ", ".join(f"{k} {ctx.cfg.value(k) if ctx.cfg is not None else None} -> {v}" for k, v in extra.items())
    return dataclasses.replace(c, overrides={**c.overrides, **extra},
                               evidence=f"{c.evidence}; other samples per step, the schedule kept in samples: {words}")


def propose(levers: tuple[Lever, ...], ctx: LeverContext, ev: Evidence,
            min_gain: float = 0.0) -> tuple[list[Candidate], dict[str, str]]:
    """Every lever's candidates, most promising first, and the reason of each lever that does not apply. An exact
    candidate's prediction is the most it can gain (the whole share removed, perfect scaling: levers.py); below
    ``min_gain`` it could be kept only by a false accept, so it is a reason, not a candidate."""
    cands, skipped = [], {}
    for lever in levers:
        got = lever.propose(ctx, ev)
        if isinstance(got, str):
            skipped[lever.name] = got
            continue
        for c in got:
            if c.may_change == EXACT and c.predicted < min_gain:
                skipped[lever.name] = (f"{c.lever}={c.value} gains at most {c.predicted:.3f}x ({c.evidence}, all of "
                                       f"it removed): below optimize.min_gain={min_gain:g}")
            else:
                cands.append(c)
    cands.sort(key=lambda c: -c.predicted)
    return cands, skipped


def search(backend: Backend, levers: tuple[Lever, ...], baseline: dict[str, Any], s: SearchSettings, *,
           planned_steps: Optional[int] = None, notice: Callable[[str], None] = print,
           clock: Callable[[], float] = time.monotonic, on_update: Callable[[SearchResult], None] = lambda _r: None,
           result: Optional[SearchResult] = None) -> SearchResult:
    """Run the progressive search from ``baseline`` (config overrides on the user's config) and return what it
    measured. ``on_update(result)`` after every profile and decision (outputs are written there, so an interrupted
    search leaves them). KeyboardInterrupt ends it with ``status=interrupted`` (the result so far is returned)."""
    t0 = clock()
    res = result or SearchResult(baseline=dict(baseline), best=dict(baseline))
    tried: set[tuple] = set()  # (candidate overrides, the best it was measured against)
    tries: dict[tuple[str, str], int] = {}  # (lever, value) → A/Bs so far
    horizons: dict[tuple, dict] = {}  # settings → their quality read at the planned run's length
    ab_costs: list[float] = []

    def left() -> float:
        return s.budget_s - (clock() - t0)

    try:
        ev = _profiled(backend, res, 0)
        on_update(res)
        while True:
            ctx = backend.context(res.best)
            cands, skipped = propose(levers, ctx, ev, s.min_gain)
            cands = [with_schedule(backend, ctx, res.best, c) for c in cands]
            res.not_applicable = skipped  # for the current best (an earlier reason may no longer hold)
            fresh = [c for c in cands if (c.key, _key(res.best)) not in tried and _changes(c, res.best)
                     and tries.get((c.lever, c.value), 0) < s.max_tries_per_value]
            res.rankings.append([{"lever": c.lever, "value": c.value, "predicted": c.predicted,
                                  "evidence": c.evidence} for c in fresh])
            if not fresh:
                res.status = "completed"
                break
            c = fresh[0]
            if c.predicted < min(NO_GAIN, s.min_predicted):
                res.not_tried += _not_tried(fresh, ["the evidence predicts a slowdown" if x.predicted < 1 else
                                                    f"the evidence predicts no gain (< {100 * (NO_GAIN - 1):g}%)"
                                                    for x in fresh])
                res.status = "completed"
                break
            if c.predicted < NO_GAIN:  # near-neutral: the models cannot tell it from 1.0, so the A/B decides
                c = dataclasses.replace(c, evidence=f"{c.evidence}; near-neutral (predicted {c.predicted:.3f}x, "
                                                    f"within optimize.min_predicted={s.min_predicted:g}..{NO_GAIN:g}"
                                                    "): measured because budget remains")
            typical = sorted(ab_costs)[len(ab_costs) // 2] if ab_costs else 0.0
            need = typical + c.warmup_s_estimate + typical * s.confirm_rounds / max(1, s.rounds)
            if ab_costs and need > left():
                res.not_tried += _not_tried(fresh, [f"budget: ~{typical + x.warmup_s_estimate:.0f} s needed, "
                                                    f"{max(0.0, left()):.0f} s left of optimize.budget_s={s.budget_s:g}"
                                                    for x in fresh])
                res.status = "budget"
                break
            tried.add((c.key, _key(res.best)))
            tries[(c.lever, c.value)] = tries.get((c.lever, c.value), 0) + 1
            planned_s = (planned_steps or 0) * (ev.step_ms or 0) / 1e3 or None
            pair = (_key(res.best), _key({**res.best, **c.overrides}))
            worse = learned_worse(*(horizons.get(k) for k in pair), s.horizon_samples, s.quality_tolerance)
            d = (Decision(c, False, f"quality guard, from earlier A/Bs of the same settings: {worse}") if worse else
                 try_candidate(backend, res.best, c, s, planned_s, clock, left_s=left()))
            h = (d.quality or {}).get("horizon")
            horizons.update({pair[0]: h["best"], pair[1]: h["candidate"]} if h else {})
            ab_costs += [] if worse else [d.seconds]
            d.evidence_index = len(res.profiles) - 1
            res.decisions.append(d)
            notice(f"optimize: {'ACCEPT' if d.accepted else 'reject'} {c.lever}={c.value} "
                   f"(predicted {c.predicted:.2f}x from {c.evidence}): {d.reason}")
            if d.accepted:
                res.best = {**res.best, **c.overrides}
                ev = _profiled(backend, res, len(res.profiles))
            on_update(res)
        if res.accepted():
            res.confirmation = confirm(backend, res.baseline, res.best, s, notice)
        res.status = res.status if res.status != "running" else "completed"
    except KeyboardInterrupt:
        res.status = "interrupted"
        notice("optimize: interrupted; writing what was measured so far")
    res.seconds = clock() - t0
    on_update(res)
    return res


def _key(settings: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def _changes(c: Candidate, best: dict[str, Any]) -> bool:
    """``c`` sets something ``best`` does not already have (not a no-op)."""
    return any(k not in best or best[k] != v for k, v in c.overrides.items())


def _profiled(backend: Backend, res: SearchResult, index: int) -> Evidence:
    """A profile of the current best, kept in ``res.profiles``."""
    ev = backend.profile(res.best, index)
    res.profiles.append({"settings": dict(res.best), **ev.as_dict()})
    return ev


def _not_tried(fresh: list[Candidate], reasons: list[str]) -> list[dict]:
    return [{"lever": x.lever, "value": x.value, "predicted": x.predicted, "reason": why}
            for x, why in zip(fresh, reasons)]


def confirm(backend: Backend, baseline: dict, best: dict, s: SearchSettings,
            notice: Callable[[str], None]) -> dict[str, Any]:
    """Baseline vs optimized, interleaved over ``confirm_rounds``: the end-to-end speedup with its interval. Windows of
    ``window_samples`` samples, not sized in steps: the baseline runs every window's samples too, often ten times
    slower per sample than the optimized config, whose steps may hold many samples."""
    try:
        with time_limit(max(s.arm_timeout_s, 60.0) * 2):
            m = measure_pair(backend, baseline, best, dataclasses.replace(s, window_steps=0), s.confirm_rounds,
                             names=("baseline", "optimized"))
            result, warm, q_base, q_best = m.result, m.warmup_s, m.quality_best, m.quality_candidate
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        notice(f"optimize: the final confirmation failed: {failure_reason(exc)}")
        return {"ratio": None, "unavailable_reason": failure_reason(exc)}
    metric = throughput_metric(result)
    ratio = result.ratio("optimized", "baseline", metric)
    notice(f"optimize: optimized vs baseline, interleaved: {ratio.describe()}")
    return {"ratio": ratio.as_dict(), "ab": result.as_dict(metric),
            "quality": {"baseline": q_base, "optimized": q_best}, "optimized_warmup_s": warm or None}

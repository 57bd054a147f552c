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
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from train.commands.optimize.arms import ArmHandle, failure_reason, time_limit
from train.commands.optimize.deadline import CostModel, Deadline, OutOfTime, budget_reason
from train.commands.optimize.judging import amortise, guard_verdict, learned_worse, quality_verdict, throughput_metric
from train.commands.optimize.pairs import (
    MIN_ROUNDS,
    PairMeasurement,
    horizon_target,
    measure_pair,
    quality_point,
    window_for,
)
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
                costs.per_sample[_key(settings)] = arm.total("seconds") / arm.total("samples")
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
                             quality_read_s=costs.quality_read_s(_key(best), s.quality_samples) if costs else 0.0)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # any failure of an arm is a rejected candidate, never a lost search
        return Decision(c, False, failure_reason(exc), seconds=clock() - t0)
    if costs is not None and m.timings:
        costs.learn(m.timings, {"best": _key(best), "candidate": _key(cand)})
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
           clock: Callable[[], float] = time.perf_counter, on_update: Callable[[SearchResult], None] = lambda _r: None,
           result: Optional[SearchResult] = None, deadline: Optional[Deadline] = None) -> SearchResult:
    """Run the progressive search from ``baseline`` (config overrides on the user's config) and return what it
    measured. ``on_update(result)`` after every profile and decision (outputs are written there, so an interrupted
    search leaves them). KeyboardInterrupt ends it with ``status=interrupted`` (the result so far is returned).

    ``deadline``: the command's (made at its start, so what ran before the search has been spent); None: one of
    ``s.budget_s`` from now on ``clock``. Every profile, A/B and the final confirmation starts only when its estimate
    (:class:`CostModel`, from measured times) fits what is left; once a lever is kept, the final confirmation's
    estimate (and the outputs' writing) is held back from the A/Bs. What does not fit is not tried, with the reason
    (:func:`budget_reason`), and ``status`` is ``budget``; ``stop_reason`` says why the search ended."""
    dl = deadline if deadline is not None else Deadline(s.budget_s, clock=clock)
    res = result or SearchResult(baseline=dict(baseline), best=dict(baseline))
    tried: set[tuple] = set()  # (candidate overrides, the best it was measured against)
    tries: dict[tuple[str, str], int] = {}  # (lever, value) → A/Bs so far
    horizons: dict[tuple, dict] = {}  # settings → their quality read at the planned run's length
    costs = CostModel()
    no_time: set[tuple] = set()  # candidates listed as not tried for the budget (the time left only shrinks)

    def update() -> None:
        t = dl.clock()
        res.seconds = dl.elapsed()
        on_update(res)
        costs.write_s = max(costs.write_s, dl.clock() - t)

    def work() -> Deadline:
        """What the A/Bs and re-profiles may use: the deadline, less the final confirmation once a lever is kept."""
        if not res.accepted():
            return dl
        need = confirm_estimate(backend, res.baseline, res.best, s, costs)
        return dl.less((need or 0.0) + costs.write_s, "the final confirmation of what was kept")

    def stop(why: str) -> None:
        res.status, res.stop_reason = "budget", why
        notice(f"optimize: {why}")

    try:
        if dl.expired():
            stop(budget_reason(dl, "the first profile", 1e-9) or "")
            update()
            return res
        try:
            ev = _profiled(backend, res, 0, costs, dl.clock)
        except OutOfTime as exc:
            stop(f"{exc}: no profile of the baseline, nothing to rank")
            update()
            return res
        update()
        while True:
            ctx = backend.context(res.best)
            cands, skipped = propose(levers, ctx, ev, s.min_gain)
            cands = [with_schedule(backend, ctx, res.best, c) for c in cands]
            res.not_applicable = skipped  # for the current best (an earlier reason may no longer hold)
            fresh = [c for c in cands if (c.key, _key(res.best)) not in tried and _changes(c, res.best)
                     and tries.get((c.lever, c.value), 0) < s.max_tries_per_value and c.key not in no_time]
            res.rankings.append([{"lever": c.lever, "value": c.value, "predicted": c.predicted,
                                  "evidence": c.evidence} for c in fresh])
            if not fresh:
                res.status = "completed"
                break
            floor = min(NO_GAIN, s.min_predicted)
            measurable = [x for x in fresh if x.predicted >= floor]
            below = [x for x in fresh if x.predicted < floor]
            if not measurable:
                res.not_tried += _not_tried(below, [_no_gain(x) for x in below])
                res.status = "completed"
                break
            budget = work()
            whys = [budget_reason(budget, f"its A/B ({MIN_ROUNDS} rounds at the least)",
                                  (pair_estimate(backend, res.best, x, s, costs, MIN_ROUNDS) or 0.0)
                                  + x.warmup_s_estimate) for x in measurable]
            late = [(x, why) for x, why in zip(measurable, whys) if why is not None]
            res.not_tried += _not_tried([x for x, _ in late], [why for _, why in late])
            no_time.update(x.key for x, _ in late)
            fits = [x for x, why in zip(measurable, whys) if why is None]
            if not fits:
                res.not_tried += _not_tried(below, [_no_gain(x) for x in below])
                stop(late[0][1] + f" (the next candidate, {late[0][0].lever}={late[0][0].value})")
                break
            c = fits[0]
            if c.predicted < NO_GAIN:  # near-neutral: the models cannot tell it from 1.0, so the A/B decides
                c = dataclasses.replace(c, evidence=f"{c.evidence}; near-neutral (predicted {c.predicted:.3f}x, "
                                                    f"within optimize.min_predicted={s.min_predicted:g}..{NO_GAIN:g}"
                                                    "): measured because budget remains")
            tried.add((c.key, _key(res.best)))
            tries[(c.lever, c.value)] = tries.get((c.lever, c.value), 0) + 1
            planned_s = (planned_steps or 0) * (ev.step_ms or 0) / 1e3 or None
            pair = (_key(res.best), _key({**res.best, **c.overrides}))
            worse = learned_worse(*(horizons.get(k) for k in pair), s.horizon_samples, s.quality_tolerance)
            d = (Decision(c, False, f"quality guard, from earlier A/Bs of the same settings: {worse}") if worse else
                 try_candidate(backend, res.best, c, s, planned_s, budget, costs,
                               confirm_from=None if res.accepted() else res.baseline))
            h = (d.quality or {}).get("horizon")
            horizons.update({pair[0]: h["best"], pair[1]: h["candidate"]} if h else {})
            d.evidence_index = len(res.profiles) - 1
            res.decisions.append(d)
            notice(f"optimize: {'ACCEPT' if d.accepted else 'reject'} {c.lever}={c.value} "
                   f"(predicted {c.predicted:.2f}x from {c.evidence}): {d.reason}")
            if d.accepted:
                res.best = {**res.best, **c.overrides}
                why = budget_reason(work(), "a re-profile of the new best", costs.profile_s[-1] if costs.profile_s
                                    else 0.0)
                if why is not None:
                    stop(f"{why}: the search ends here")
                    update()
                    break
                try:
                    ev = _profiled(backend, res, len(res.profiles), costs, dl.clock)
                except OutOfTime as exc:
                    stop(f"{exc}: the search ends here")
                    update()
                    break
            update()
        if res.accepted():
            res.confirmation = confirm(backend, res.baseline, res.best, s, notice, deadline=dl.less(
                costs.write_s, "writing the outputs"), costs=costs)
        res.status = res.status if res.status != "running" else "completed"
        if res.status == "completed" and (no_time or any(d.reason.startswith("budget:") or "cut short" in d.reason
                                                         for d in res.decisions)):  # the budget bound some of it
            res.status = "budget"
    except KeyboardInterrupt:
        res.status = "interrupted"
        notice("optimize: interrupted; writing what was measured so far")
    update()
    return res


def pair_estimate(backend: Backend, best: dict, c: Candidate, s: SearchSettings, costs: CostModel,
                  rounds: int) -> Optional[float]:
    """The seconds of an A/B of ``c`` against ``best`` with ``rounds`` timed rounds (:meth:`CostModel.pair_s`: the
    fixed seconds, then both arms' warm-up and windows at their measured speeds, ``c``'s at its prediction until
    timed); None before anything was timed."""
    cand = {**best, **c.overrides}
    window = window_for(backend, (best, cand), s.window_samples, s.window_steps, s.max_window_samples)
    warm, _before = quality_point(s, s.rounds, window)
    got = costs.pair_s(_key(best), _key(cand), warm + rounds * window, c.predicted)
    return None if got is None else got + (0.0 if costs.fixed else 2 * costs.quality_read_s(_key(best),
                                                                                            s.quality_samples))


def confirm_estimate(backend: Backend, baseline: dict, best: dict, s: SearchSettings, costs: CostModel,
                     rounds: Optional[int] = None) -> Optional[float]:
    """The seconds of the final confirmation (``rounds``, default ``s.confirm_rounds``, windows of
    ``s.window_samples``: :func:`confirm`) at both settings' measured seconds per sample."""
    rounds = s.confirm_rounds if rounds is None else rounds
    window = s.window_samples
    warm, _before = quality_point(s, s.confirm_rounds, window)
    got = costs.pair_s(_key(baseline), _key(best), warm + rounds * window)
    return None if got is None else got + (0.0 if costs.fixed else 2 * costs.quality_read_s(_key(baseline),
                                                                                            s.quality_samples))


def _key(settings: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def _changes(c: Candidate, best: dict[str, Any]) -> bool:
    """``c`` sets something ``best`` does not already have (not a no-op)."""
    return any(k not in best or best[k] != v for k, v in c.overrides.items())


def _profiled(backend: Backend, res: SearchResult, index: int, costs: Optional[CostModel] = None,
              clock: Callable[[], float] = time.perf_counter) -> Evidence:
    """A profile of the current best, kept in ``res.profiles``; ``costs`` learns its seconds, its build's and, until
    an A/B has timed the settings, their seconds per sample (the step before the profiler records, else the profiled
    steps')."""
    t0 = clock()
    ev = backend.profile(res.best, index)
    res.profiles.append({"settings": dict(res.best), **ev.as_dict()})
    if costs is not None:
        costs.profile_s.append(clock() - t0)
        if ev.steps_s is not None:
            costs.build_s.append(max(0.0, costs.profile_s[-1] - ev.steps_s))
        rate = ev.unprofiled_samples_per_s or ev.samples_per_s
        if rate:
            costs.per_sample.setdefault(_key(res.best), 1.0 / rate)
    return ev


def _no_gain(c: Candidate) -> str:
    return ("the evidence predicts a slowdown" if c.predicted < 1 else
            f"the evidence predicts no gain (< {100 * (NO_GAIN - 1):g}%)")


def _not_tried(fresh: list[Candidate], reasons: list[str]) -> list[dict]:
    return [{"lever": x.lever, "value": x.value, "predicted": x.predicted, "reason": why}
            for x, why in zip(fresh, reasons)]


def confirm(backend: Backend, baseline: dict, best: dict, s: SearchSettings, notice: Callable[[str], None],
            deadline: Optional[Deadline] = None, costs: Optional[CostModel] = None) -> dict[str, Any]:
    """Baseline vs optimized, interleaved over ``confirm_rounds``: the end-to-end speedup with its interval. Windows of
    ``window_samples`` samples, not sized in steps: the baseline runs every window's samples too, often ten times
    slower per sample than the optimized config, whose steps may hold many samples. ``deadline``: not started unless
    :data:`MIN_ROUNDS` rounds fit it (``costs``' estimate), and no round started past it (``cut_short`` says after
    how many)."""
    if deadline is not None and costs is not None:
        why = budget_reason(deadline, f"the final confirmation ({MIN_ROUNDS} rounds at the least)",
                            confirm_estimate(backend, baseline, best, s, costs, MIN_ROUNDS) or 0.0)
        if why is not None:
            notice(f"optimize: no final confirmation: {why}")
            return {"ratio": None, "unavailable_reason": why}
    try:
        limit = max(s.arm_timeout_s, 60.0) * 2
        own = None if deadline is None else deadline.within(limit, "the final confirmation's limit")
        with time_limit(limit):
            m = measure_pair(backend, baseline, best, dataclasses.replace(s, window_steps=0), s.confirm_rounds,
                             names=("baseline", "optimized"), deadline=own,
                             quality_read_s=costs.quality_read_s(_key(baseline), s.quality_samples) if costs else 0.0)
            result, warm, q_base, q_best = m.result, m.warmup_s, m.quality_best, m.quality_candidate
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        notice(f"optimize: the final confirmation failed: {failure_reason(exc)}")
        return {"ratio": None, "unavailable_reason": failure_reason(exc)}
    metric = throughput_metric(result)
    ratio = result.ratio("optimized", "baseline", metric)
    notice(f"optimize: optimized vs baseline, interleaved: {ratio.describe()}"
           + (f" ({m.cut_short})" if m.cut_short else ""))
    return {"ratio": ratio.as_dict(), "ab": result.as_dict(metric),
            "quality": {"baseline": q_base, "optimized": q_best}, "optimized_warmup_s": warm or None,
            "cut_short": m.cut_short}

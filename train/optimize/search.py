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
from typing import Any, Optional

from train.optimize.arms import failure_reason, time_limit
from train.optimize.candidate import Backend, confirm_estimate, pair_estimate, settings_key, try_candidate
from train.optimize.deadline import CostModel, Deadline, OutOfTime, budget_reason
from train.optimize.judging import learned_worse, throughput_metric
from train.optimize.pairs import (
    MIN_ROUNDS,
    measure_pair,
)
from train.optimize.proposals import EXACT, Candidate, Evidence, Lever, LeverContext
from train.optimize.results import Decision, SearchResult
from train.optimize.settings import NO_GAIN, SearchSettings


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
    """The progressive search from ``baseline`` (overrides on the user's config): what it measured.
    ``on_update(result)`` after every profile and decision (the outputs are written there); KeyboardInterrupt ends it
    with ``status=interrupted``. ``deadline``: the command's (None: ``s.budget_s`` from now on ``clock``); what does
    not fit it is not tried, with the reason (module docstring, docs/optimize.md "The budget")."""
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
        return _work(backend, res, s, dl, costs)

    def stop(why: str) -> None:
        res.status, res.stop_reason = "budget", why
        notice(f"optimize: {why}")

    try:
        ev = _first_profile(backend, res, dl, costs, stop)
        update()
        if ev is None:
            return res
        while True:
            ctx = backend.context(res.best)
            oom = [d.candidate for d in res.decisions if d.reason.startswith("out of memory")
                   and d.candidate.lever != "checkpoint_blocks"]
            if oom:  # memory, not speed, refused it: what the block-checkpointing lever proposes from
                ctx = dataclasses.replace(ctx, out_of_memory=oom[-1])
            cands, skipped = propose(levers, ctx, ev, s.min_gain)
            cands = [with_schedule(backend, ctx, res.best, c) for c in cands]
            res.not_applicable = skipped  # for the current best (an earlier reason may no longer hold)
            fresh = [c for c in cands if (c.key, settings_key(res.best)) not in tried and _changes(c, res.best)
                     and tries.get((c.lever, c.value), 0) < s.max_tries_per_value and c.key not in no_time]
            res.rankings.append([{"lever": c.lever, "value": c.value, "predicted": c.predicted,
                                  "evidence": c.evidence} for c in fresh])
            if not fresh:
                res.status = "completed"
                break
            budget = work()
            c, why = _select(backend, res, fresh, s, budget, costs, no_time)
            if c is None:
                if why is None:
                    res.status = "completed"
                else:
                    stop(why)
                break
            tried.add((c.key, settings_key(res.best)))
            tries[(c.lever, c.value)] = tries.get((c.lever, c.value), 0) + 1
            planned_s = (planned_steps or 0) * (ev.step_ms or 0) / 1e3 or None
            d = _measure(backend, res, c, s, planned_s, budget, costs, horizons)
            notice(f"optimize: {'ACCEPT' if d.accepted else 'reject'} {c.lever}={c.value} "
                   f"(predicted {c.predicted:.2f}x from {c.evidence}): {d.reason}")
            if d.accepted:
                res.best = {**res.best, **c.overrides}
                ev = _reprofile(backend, res, work(), dl, costs, stop)
                if ev is None:
                    update()
                    break
            update()
        if res.accepted():
            res.confirmation = confirm(backend, res.baseline, res.best, s, notice, deadline=dl.less(
                costs.write_s, "writing the outputs"), costs=costs)
        res.status = _final_status(res, no_time)
    except KeyboardInterrupt:
        res.status = "interrupted"
        notice("optimize: interrupted; writing what was measured so far")
    update()
    return res


def _work(backend: Backend, res: SearchResult, s: SearchSettings, dl: Deadline, costs: CostModel) -> Deadline:
    """What the A/Bs and re-profiles may use: the deadline, less the final confirmation once a lever is kept."""
    if not res.accepted():
        return dl
    need = confirm_estimate(backend, res.baseline, res.best, s, costs)
    return dl.less((need or 0.0) + costs.write_s, "the final confirmation of what was kept")


def _reprofile(backend: Backend, res: SearchResult, budget: Deadline, dl: Deadline, costs: CostModel,
               stop: Callable[[str], None]) -> Optional[Evidence]:
    """The new best's profile (the bottleneck moves), or None (said through ``stop``) when it does not fit."""
    why = budget_reason(budget, "a re-profile of the new best", costs.profile_s[-1] if costs.profile_s else 0.0)
    if why is not None:
        stop(f"{why}: the search ends here")
        return None
    try:
        return _profiled(backend, res, len(res.profiles), costs, dl.clock)
    except OutOfTime as exc:
        stop(f"{exc}: the search ends here")
        return None


def _first_profile(backend: Backend, res: SearchResult, dl: Deadline, costs: CostModel,
                   stop: Callable[[str], None]) -> Optional[Evidence]:
    """The baseline's profile, or None (said through ``stop``) when the budget is gone before or during it."""
    if dl.expired():
        stop(budget_reason(dl, "the first profile", 1e-9) or "")
        return None
    try:
        return _profiled(backend, res, 0, costs, dl.clock)
    except OutOfTime as exc:
        stop(f"{exc}: no profile of the baseline, nothing to rank")
        return None


def _select(backend: Backend, res: SearchResult, fresh: list[Candidate], s: SearchSettings, budget: Deadline,
            costs: CostModel, no_time: set[tuple]) -> tuple[Optional[Candidate], Optional[str]]:
    """The next candidate to A/B among ``fresh`` (ranked), or ``(None, why)``: ``why`` None when nothing measurable
    is left (the search is complete), else the budget's reason. Candidates the budget rules out are listed in
    ``res.not_tried`` and remembered in ``no_time`` (the time left only shrinks)."""
    floor = min(NO_GAIN, s.min_predicted)
    measurable = [x for x in fresh if x.predicted >= floor]
    below = [x for x in fresh if x.predicted < floor]
    if not measurable:
        res.not_tried += _not_tried(below, [_no_gain(x) for x in below])
        return None, None
    whys = [budget_reason(budget, f"its A/B ({MIN_ROUNDS} rounds at the least)",
                          (pair_estimate(backend, res.best, x, s, costs, MIN_ROUNDS) or 0.0)
                          + x.warmup_s_estimate) for x in measurable]
    late = [(x, why) for x, why in zip(measurable, whys) if why is not None]
    res.not_tried += _not_tried([x for x, _ in late], [why for _, why in late])
    no_time.update(x.key for x, _ in late)
    fits = [x for x, why in zip(measurable, whys) if why is None]
    if not fits:
        res.not_tried += _not_tried(below, [_no_gain(x) for x in below])
        return None, late[0][1] + f" (the next candidate, {late[0][0].lever}={late[0][0].value})"
    c = fits[0]
    if c.predicted < NO_GAIN:  # near-neutral: the models cannot tell it from 1.0, so the A/B decides
        c = dataclasses.replace(c, evidence=f"{c.evidence}; near-neutral (predicted {c.predicted:.3f}x, "
                                            f"within optimize.min_predicted={s.min_predicted:g}..{NO_GAIN:g}"
                                            "): measured because budget remains")
    return c, None


def _measure(backend: Backend, res: SearchResult, c: Candidate, s: SearchSettings, planned_s: Optional[float],
             budget: Deadline, costs: CostModel, horizons: dict[tuple, dict]) -> Decision:
    """``c``'s decision against the current best (an A/B, or the quality guard from earlier A/Bs of the same
    settings), appended to ``res.decisions``; the quality read at the planned run's length kept in ``horizons``."""
    pair = (settings_key(res.best), settings_key({**res.best, **c.overrides}))
    worse = learned_worse(*(horizons.get(k) for k in pair), s.horizon_samples, s.quality_tolerance)
    d = (Decision(c, False, f"quality guard, from earlier A/Bs of the same settings: {worse}") if worse else
         try_candidate(backend, res.best, c, s, planned_s, budget, costs,
                       confirm_from=None if res.accepted() else res.baseline))
    h = (d.quality or {}).get("horizon")
    horizons.update({pair[0]: h["best"], pair[1]: h["candidate"]} if h else {})
    d.evidence_index = len(res.profiles) - 1
    res.decisions.append(d)
    return d


def _final_status(res: SearchResult, no_time: set[tuple]) -> str:
    """``completed``, or ``budget`` where the budget bound some of the search."""
    status = res.status if res.status != "running" else "completed"
    if status == "completed" and (no_time or any(d.reason.startswith("budget:") or "cut short" in d.reason
                                                 for d in res.decisions)):
        return "budget"
    return status


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
            costs.per_sample.setdefault(settings_key(res.best), 1.0 / rate)
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
                             quality_read_s=(costs.quality_read_s(settings_key(baseline), s.quality_samples)
                                             if costs else 0.0))
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

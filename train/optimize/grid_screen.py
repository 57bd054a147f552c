"""``optimize-grid``'s screening: every combination interleaved in one process over ``optimize.grid_rounds`` rounds —
enough to drop the clearly slow, too few to rank the close ones — (:func:`screen`), then judged by the search's
quality guard in the screening's order until ``optimize.grid_finalists`` learn as well (:func:`pick_finalists`),
each against the reference the search would have held it to (:func:`quality_guard`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from train.optimize.arms import ArmSet
from train.optimize.grid_space import twin_of
from train.optimize.judging import guard_verdict, throughput_metric
from train.optimize.outputs import format_loss
from train.optimize.settings import SearchSettings
from train.perf.ab import ABResult


@dataclass
class Rates:
    """An A/B's medians as samples per second: compared by ``metric`` (:func:`~train.optimize.judging.
    throughput_metric`: real tokens per second where counted), reported ÷ ``per_sample`` (every arm trains the same
    samples)."""

    metric: str
    per_sample: float

    def of(self, result: ABResult, name: str) -> Optional[float]:
        m = result.arms[name].median(self.metric)
        return None if m is None else m / self.per_sample


@dataclass
class Screening:
    """What the screening measured: the A/B, every arm's quality after the search's verdict samples, the rates,
    and ``ranked``: the grid's combinations (not ``baseline`` nor ``optimized``), fastest first."""

    result: ABResult
    quality: dict[str, dict]
    rates: Rates
    medians: dict[str, Optional[float]]
    ranked: list[str]
    seconds: float


@dataclass
class Judged:
    """The quality guard's verdicts (``{passes, why}``; ``passes`` None: not judged), the finalists, and the arms
    trained on to the horizon for theirs."""

    guard: dict[str, dict]
    finalists: list[str]
    late: list[str]
    seconds: float


def screen(arms: ArmSet, named: dict[str, dict[str, Any]], rounds: int, window: int, quality_after: int,
           backend: Any, bar: Any) -> Screening:
    """Build and warm every arm of ``named``, interleave them over ``rounds`` windows of ``window`` samples, then
    train each on, untimed, to ``quality_after`` samples (where the search reads its verdicts) and read its quality.
    The arms stay open in ``arms`` (a verdict may train one on to the horizon)."""
    t0 = time.perf_counter()
    for name, point in named.items():
        arms.build(name, point)
        arms.warm(name, window)
        bar.update(1)
    result = arms.interleave(rounds, window, on_round=lambda _r: bar.update(len(named)))
    quality = {}
    for name in named:
        arms.train_to(name, quality_after)
        quality[name] = arms.quality(name)
        bar.update(1)
    seconds = time.perf_counter() - t0
    metric = throughput_metric(result)
    rates = Rates(metric, backend.real_tokens_per_sample() if metric == "real_tokens" else 1.0)
    medians = {n: rates.of(result, n) for n in named}
    ranked = sorted((n for n in named if n not in ("optimized", "baseline")), key=lambda n: -(medians[n] or 0))
    return Screening(result, quality, rates, medians, ranked, seconds)


def quality_guard(named: dict[str, dict[str, Any]], quality: dict[str, dict], tolerance: float,
                  at_horizon: Optional[Callable[[str], dict]] = None, names: Optional[list[str]] = None,
                  base_steps: Optional[int] = None) -> dict[str, dict]:
    """Each arm's quality verdict ``{passes, why}`` by the search's rule (:func:`~train.optimize.judging.
    guard_verdict`, every arm after the same samples), against the reference the search would have held it to:
    its :func:`~train.optimize.grid_space.twin_of` — which must itself pass — else the config as given
    (``baseline``). An arm whose optimizer steps per sample differ from its reference's (``train.max_steps``,
    ``base_steps`` where unset) is judged, with its reference, on ``at_horizon(name)`` — the quality after
    ``optimize.horizon_fraction`` of the planned run — when given, as the search judges such a lever. ``names``: the
    arms to judge (default: every arm in ``quality``; the references they need are judged too)."""
    done: dict[str, dict[str, Any]] = {}

    def verdict(name: str) -> dict[str, Any]:
        if name in done:
            return done[name]
        twin = twin_of(named, name)
        ref, words = (twin, f"{twin} (the combination it grows from)") if twin else ("baseline",
                                                                                      "the config as given")
        if twin:
            first = verdict(twin)
            if not first["passes"]:
                done[name] = {"passes": False, "why": f"grown from {twin}, which learns worse: {first['why']}"}
                return done[name]
        steps = [named[n].get("train.max_steps", base_steps) for n in (name, ref)]
        late = at_horizon is not None and name != "baseline" and steps[0] != steps[1]
        ok, why = guard_verdict((quality[ref], quality[name]), tolerance, words,
                                late=(at_horizon(ref), at_horizon(name)) if late else None,
                                note="other steps per sample, judged late in the run")
        done[name] = {"passes": ok, "why": why}
        return done[name]

    return {n: verdict(n) for n in (names if names is not None else list(quality))}


def pick_finalists(arms: ArmSet, named: dict[str, dict[str, Any]], sc: Screening, s: SearchSettings, n: int,
                   base_steps: Optional[int], notice: Callable[[str], None]) -> Judged:
    """The quality guard on ``baseline`` and ``optimized``, then on the combinations in the screening's order until
    ``n`` learn as well: those are the finalists (none passing: the ``n`` fastest). An arm judged at the horizon
    (``s.horizon_samples``) is trained on there, untimed, on demand, once."""
    t0 = time.perf_counter()
    late: dict[str, dict] = {}

    def at_horizon(name: str) -> dict:
        if name not in late:
            t = time.perf_counter()
            arms.train_to(name, s.horizon_samples)
            late[name] = arms.quality(name)
            notice(f"optimize-grid: {name} trained on to {arms.seen[name]} samples for its quality verdict "
                   f"({time.perf_counter() - t:.0f} s): held-out loss {format_loss(late[name].get('loss'))}")
        return late[name]

    def judge(names: list[str]) -> dict[str, dict]:
        return quality_guard(named, sc.quality, s.quality_tolerance, at_horizon if s.horizon_samples else None,
                             names, base_steps)

    guard = judge(["baseline"] + (["optimized"] if "optimized" in named else []))
    passing: list[str] = []
    for name in sc.ranked:  # a late verdict trains on: judged only until enough learn as well
        guard.update(judge([name]))
        if guard[name]["passes"]:
            passing.append(name)
        if len(passing) == n:
            break
    for name in sc.ranked:
        guard.setdefault(name, {"passes": None, "why": "not judged: below the finalists in the screening"})
    return Judged(guard, (passing or sc.ranked)[:n], sorted(late), time.perf_counter() - t0)

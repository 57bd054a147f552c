"""How ``make optimize`` judges an A/B: the rate it compares arms by, a one-off cost charged over the planned run,
and the quality guard's verdict. Shared by the search (search.py) and ``optimize-grid`` (grid.py); an arm that
fails is not judged here but where arms run (arms.py)."""

from __future__ import annotations

import math
from typing import Any, Optional

from train.perf.ab import ABResult, Ratio


def throughput_metric(result: ABResult) -> str:
    """The rate the search compares arms by: ``real_tokens`` per second where every window counted them, else
    ``samples`` per second. Over an epoch both give the same ratio (every arm trains every sample once, so the same
    real tokens); within a window of ``window_samples`` samples the real tokens are the better measure of the work
    done. A window that ends at a sample count over-weights batches holding many short samples when an arm's batches
    differ in size (a token budget: 128 short samples or 16 long ones per batch); docs/optimize.md, "Why real tokens
    per second", has a measurement."""
    windows = [w for arm in result.arms.values() for w in arm.windows]
    return "real_tokens" if windows and all(w.counts.get("real_tokens") for w in windows) else "samples"


def amortise(ratio: Ratio, warmup_s: float, planned_s: Optional[float]) -> dict[str, Any]:
    """A steady-state ratio with a one-off cost ``warmup_s`` paid once over a run that takes ``planned_s`` at the
    current best's speed: ``planned_s / (planned_s / r + warmup_s)`` for the median and each interval bound (the map is
    increasing in ``r``). ``planned_s`` None or 0: the steady ratio."""
    d = ratio.as_dict()
    if not warmup_s or not planned_s:
        return d

    def f(r: Optional[float]) -> Optional[float]:
        return None if r is None or r <= 0 else planned_s / (planned_s / r + warmup_s)

    d.update(median=f(d["median"]), low=f(d["low"]), high=f(d["high"]), amortised_over_s=planned_s,
             warmup_s=warmup_s)
    d["verdict"] = ("faster" if d["low"] and d["low"] > 1 else
                    "slower" if d["high"] and d["high"] < 1 else "no measurable difference")
    return d


def learned_worse(best: Optional[dict], cand: Optional[dict], horizon: Optional[int],
                  tolerance: float) -> Optional[str]:
    """Why settings ``cand`` fail the quality guard against ``best``, from both settings' quality at the planned
    run's length (at least ``horizon`` samples seen; dicts as :func:`quality_verdict` takes) read in earlier A/Bs;
    None when either was not read there or the guard passes. The same settings train the same model (each arm's
    random stream is its own), so the verdict needs no new A/B: a token budget rejected against one best and
    proposed again against a larger kept budget would read the same held-out loss."""
    if not (best and cand and horizon) or min(best.get("samples_seen", 0), cand.get("samples_seen", 0)) < horizon:
        return None
    ok, why = quality_verdict(best, cand, tolerance)
    return None if ok else why


def quality_verdict(best: dict[str, Any], cand: dict[str, Any], tolerance: float,
                    reference: str = "the current best") -> tuple[bool, str]:
    """(passes, why): no non-finite step, a finite held-out loss, and that loss ≤ the reference's (``best``, named
    ``reference`` in ``why``) × (1 + ``tolerance``)."""
    if cand.get("nonfinite_steps"):
        return False, f"{cand['nonfinite_steps']} non-finite step(s) (skipped by the numerics guard)"
    loss, ref = cand.get("loss"), best.get("loss")
    if loss is None or not math.isfinite(loss):
        return False, f"held-out loss is {loss}"
    if ref is None or not math.isfinite(ref):
        return True, f"held-out loss {loss:.4f} ({reference}'s is {ref}: no comparison)"
    limit = ref * (1 + tolerance)
    if loss > limit:
        return False, (f"held-out loss {loss:.4f} > {limit:.4f} ({reference}'s {ref:.4f} + "
                       f"{100 * tolerance:g}%) after the same samples")
    return True, f"held-out loss {loss:.4f} vs {ref:.4f} (tolerance +{100 * tolerance:g}%)"


def guard_verdict(early: tuple[dict, dict], tolerance: float, reference: str = "the current best",
                  late: Optional[tuple[dict, dict]] = None, samples: Optional[int] = None,
                  note: str = "") -> tuple[bool, str]:
    """The quality guard on a candidate against its reference, as the search and ``optimize-grid`` both apply it:
    ``(reference's quality, candidate's)`` read after the same samples (``early``: after
    :meth:`~train.optimize.settings.SearchSettings.quality_samples_seen`), or — for a candidate on other
    optimizer steps per sample, behind early in training — ``late``, both read after training on to the planned
    run's horizon; ``why`` then says at how many ``samples`` (default: the candidate's samples seen) and ``note``."""
    if late is None:
        return quality_verdict(*early, tolerance, reference)
    ok, why = quality_verdict(*late, tolerance, reference)
    at = late[1].get("samples_seen") if samples is None else samples
    return ok, f"{why} (at {at} samples: {note})"

"""How ``make optimize`` judges an A/B: the rate it compares arms by, a one-off cost charged over the planned run,
and the quality guard's verdict; an arm that fails (out of memory, an exception, past ``optimize.arm_timeout_s``)
in one line. Shared by the search (search.py) and ``optimize-grid`` (grid.py)."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator
from typing import Any, Optional

from train.perf.ab import ABResult, Ratio


def throughput_metric(result: ABResult) -> str:
    """The rate the search compares arms by: ``real_tokens`` per second where every window counted them, else
    ``samples`` per second. Over an epoch both give the same ratio (every arm trains every sample once, so the same
    real tokens); within a window of ``window_samples`` samples the real tokens are the better measure of the work
    done. A window that ends at a sample count over-weights batches holding many short samples when an arm's batches
    differ in size (a token budget: 128 short samples or 16 long ones per batch): measured on WordNet (2-core CPU,
    bf16 fitted buckets), a 4096-token budget against batches of 32 read 1.33x [0.57, 1.89] in samples per second
    and 0.91x [0.75, 1.24] in real tokens per second in the same windows."""
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
    random stream is its own), so the verdict needs no new A/B: in opt-naive-11 a 16384-token budget, rejected on
    a 4096 budget, was proposed again once 8192 was kept and read the same held-out loss, 2.5582, after 74 s more."""
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


class ArmTimeout(Exception):
    """A candidate ran past ``optimize.arm_timeout_s``."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`ArmTimeout` in the main thread after ``seconds`` (SIGALRM; no limit off the main thread or where
    the OS has no SIGALRM). A call stuck inside C code that never returns to Python is not interruptible this way."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_sig, _frame):
        raise ArmTimeout(f"ran past optimize.arm_timeout_s={seconds:g} s (a hang, or too slow to measure)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def failure_reason(exc: BaseException) -> str:
    """One line for a failed arm: ``out of memory: …``, ``timed out: …``, ``hit the recompile limit: …`` or
    ``raised <Type>: …``."""
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    if isinstance(exc, ArmTimeout):
        return f"timed out: {text}"
    if isinstance(exc, MemoryError) or "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError":
        return f"out of memory: {text or type(exc).__name__}"
    if "recompile" in text.lower() and "limit" in text.lower():
        return f"hit the recompile limit: {text}"
    return f"raised {type(exc).__name__}: {text}"

"""``optimize-grid``'s final and re-check: the finalists re-measured over ``optimize.confirm_rounds`` — against each
other, or, with ``--optimized``, each against the search's result alone, two arms interleaved as the search's A/Bs
are — each A/B in a new process (isolated.py); then the best, the largest of several noisy ratios (the winner's
curse), measured once more against the search's result, in one more new process, over ``optimize.recheck_rounds``
(the re-check: the search is judged on windows the pick never saw). Successive halving (Jamieson & Talwalkar 2016):
the best is picked, and its ratios measured, from enough paired rounds, not from the screening's few windows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from train.errors import UserError
from train.optimize.grid_screen import Rates
from train.optimize.isolated import IsolatedFailure, measure_in_fresh_process
from train.optimize.pairs import window_for
from train.perf.ab import ABResult

FINAL_WINDOW_STEPS = 16
"""The final's and the re-check's timed windows hold at least this many optimizer steps of the pair's arm with the
most samples per step (``optimize.window_samples`` at the least): a window of a few steps times whichever buckets
came up, and the per-round ratios of a few-step window spread too wide to decide (docs/optimize.md)."""


def timeout_for(arm_timeout_s: float, arms: int) -> float:
    """Seconds an A/B of ``arms`` arms may take: ``optimize.arm_timeout_s`` bounds an A/B of two, and every arm
    adds its own warm-up and windows, so a final of four finalists in one process gets twice that."""
    return arm_timeout_s * max(1.0, arms / 2)


@dataclass
class Final:
    """The measured finalists (``pairs``: each → the A/B it was measured in), those whose A/B ``failed`` (→ why), the
    ``best``, and the re-check (or why it failed)."""

    pairs: dict[str, ABResult]
    failed: dict[str, str]
    best: str
    recheck: Optional[ABResult] = None
    recheck_failed: Optional[str] = None

    @property
    def finalists(self) -> list[str]:
        return list(self.pairs)


def run_final(config_path: Path, backend: Any, named: dict[str, dict[str, Any]], finalists: list[str], o: Any,
              work_dir: Path, rates: Rates, bar: Any, notice: Callable[[str], None]) -> Final:
    """The final of ``finalists`` (module docstring), with the re-check when ``named`` holds ``optimized``; each A/B
    in ``work_dir/<n>`` (the re-check in ``work_dir/recheck``) on the config at ``config_path``.

    Raises:
        UserError: no finalist could be measured.
    """
    paired = "optimized" in named
    failed: dict[str, str] = {}

    def fresh(group: list[str], work: str, rounds: int) -> ABResult:
        window = window_for(backend, [named[n] for n in group], o.window_samples, FINAL_WINDOW_STEPS)
        return measure_in_fresh_process(config_path, {n: named[n] for n in group}, rounds=rounds,
                                        window_samples=window, warmup_samples=o.window_samples,
                                        work_dir=work_dir / work, timeout_s=timeout_for(o.arm_timeout_s, len(group)))

    def measure(group: list[str], index: int) -> Optional[ABResult]:  # a failure leaves its finalists unmeasured
        try:
            return fresh(group, str(index), o.confirm_rounds)
        except IsolatedFailure as e:
            failed.update({n: str(e) for n in group if n != "optimized"})
            notice(f"optimize-grid: the final of {', '.join(group)} failed: {e}")
            return None
        finally:
            bar.update(len(group) * o.confirm_rounds)

    if not paired:
        result = measure(finalists, 0)
        pairs = {n: result for n in finalists} if result is not None else {}
    else:
        pairs = {n: r for i, n in enumerate(finalists) if (r := measure(["optimized", n], i)) is not None}
    if not pairs:
        raise UserError(f"optimize-grid: no finalist could be measured: {next(iter(failed.values()))}")
    if not paired:
        return Final(pairs, failed, max(pairs, key=lambda n: rates.of(pairs[n], n) or 0))
    final = Final(pairs, failed, max(pairs, key=lambda n: pairs[n].ratio(n, "optimized", rates.metric).median or 0))
    try:
        final.recheck = fresh(["optimized", final.best], "recheck", o.recheck_rounds)
    except IsolatedFailure as e:
        final.recheck_failed = str(e)
        notice(f"optimize-grid: the re-check of {final.best} failed: {e}")
    bar.update(2 * o.recheck_rounds)
    return final

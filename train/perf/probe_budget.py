"""How much of a run the ``auto`` probes may spend (``train.probe_budget``).

An ``auto`` decision that is not cached measures full training steps of the run's own model: the attention path
(one step per path and round) and the chunked loss (both ways, in rounds), each about a dozen steps. On a 135M model on
a 2-core CPU a step takes seconds, so on a 30-step run the probes took longer than the training. The budget lets the
probes spend at most ``train.probe_budget`` (a fraction) of the run's projected training, counted in steps: a probe
step is a step of the run's own model on one of its batches, so its share of the steps is its share of the time, and
nothing has to be timed to decide (a step timed first would itself cost seconds). A probe that would pass the budget
is not run: its decision takes the rule's default and says so, and the console says what is measured while it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional


class ProbeBudget:
    """The probes' allowance for one run: ``fraction`` × ``total_steps`` (train/setup.py ``projected_steps``) probe
    steps (``fraction`` or ``total_steps`` None: unlimited). ``say``: where the progress lines go; ``clock``: the
    wall clock of the decisions block's seconds."""

    def __init__(self, fraction: Optional[float], total_steps: Optional[int], say: Callable[..., None] = print,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.fraction, self.total_steps, self.say, self.clock = fraction, total_steps, say, clock
        self.planned_steps = 0
        self.started = clock()
        self.measured: list[str] = []
        self.skipped: list[str] = []

    def allowance_steps(self) -> Optional[float]:
        if self.fraction is None or self.total_steps is None:
            return None
        return float(self.fraction) * int(self.total_steps)

    def check(self, what: str, steps: int) -> Optional[str]:
        """None when ``what`` may run its ``steps`` probe steps (said on the console, counted), else why not (one
        clause for the decision's reason)."""
        allowance = self.allowance_steps()
        if allowance is not None and self.planned_steps + steps > allowance:
            self.skipped.append(what)
            return (f"not measured: its {steps} probe steps would take the auto probes past "
                    f"train.probe_budget={self.fraction:g} of this run's {self.total_steps} steps "
                    f"({allowance:.1f} steps)")
        self.planned_steps += steps
        self.measured.append(what)
        self.say(f"probing {what}: {steps} training steps ...", flush=True)
        return None

    def line(self) -> Optional[str]:
        """The decisions block's ``probes`` line (None when nothing was probed or skipped)."""
        if not self.measured and not self.skipped:
            return None
        parts = [f"{self.clock() - self.started:.1f} s deciding"]
        allowance = self.allowance_steps()
        if allowance is not None:
            parts.append(f"allowed {allowance:.1f} probe steps (train.probe_budget={self.fraction:g} of "
                         f"{self.total_steps} steps)")
        if self.measured:
            parts.append(f"measured: {', '.join(self.measured)}")
        if self.skipped:
            parts.append(f"not measured: {', '.join(self.skipped)}")
        return "; ".join(parts)

    def report(self) -> dict[str, Any]:
        """report.json ``probes``."""
        return {"seconds": round(self.clock() - self.started, 3), "budget_fraction": self.fraction,
                "projected_steps": self.total_steps, "allowance_steps": self.allowance_steps(),
                "probe_steps": self.planned_steps, "measured": list(self.measured), "not_measured": list(self.skipped)}

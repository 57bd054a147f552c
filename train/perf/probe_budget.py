"""How much of a run the ``auto`` probes may spend (``train.probe_budget``).

An ``auto`` decision that is not cached measures full training steps of the run's own model: the attention path
(one step per path and round) and the chunked loss (both ways, in rounds), each about a dozen steps. On a 135M
model on a 2-core CPU a step takes seconds, so on a 30-step run the probes took longer than the training. The budget
lets the probes spend at most ``train.probe_budget`` (a fraction) of the run's projected training time, ``max_steps``
× the seconds of one step (the second of two on the first probe's batch, inside its restoring context: the run's
state is untouched). A probe that would pass it is not run: its decision takes the rule's default and says so, and
the console says what is measured while it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from train.perf.timer import Timed


class ProbeBudget:
    """The probes' allowance for one run: ``fraction`` × ``total_steps`` (train/setup.py ``projected_steps``) × one
    step's seconds (``fraction`` or ``total_steps`` None: unlimited). ``say``: where the progress lines go;
    ``clock``: the step timer's clock (seconds)."""

    def __init__(self, fraction: Optional[float], total_steps: Optional[int], device: torch.device,
                 say: Callable[..., None] = print, clock: Callable[[], float] = time.perf_counter) -> None:
        self.fraction, self.total_steps, self.device, self.say, self.clock = fraction, total_steps, device, say, clock
        self.step_s: Optional[float] = None
        self.planned_s = 0.0
        self.started = time.perf_counter()
        self.measured: list[str] = []
        self.skipped: list[str] = []

    @property
    def limited(self) -> bool:
        return self.fraction is not None and self.total_steps is not None

    def allowance_s(self) -> Optional[float]:
        if not self.limited or self.step_s is None:
            return None
        return float(self.fraction) * int(self.total_steps) * self.step_s

    def check(self, what: str, steps: int, step: Callable[[dict], Any], batch: dict) -> Optional[str]:
        """None when ``what`` may run its ``steps`` probe steps (said on the console, counted), else why not (one
        clause for the decision's reason). The first check of a limited budget times ``step(batch)`` (twice)."""
        if self.limited and self.step_s is None:  # the second of two steps: the first pays one-time set-up
            for _ in range(2):
                with Timed(self.device, self.clock) as t:
                    step(batch)
            self.step_s = t.ms / 1e3
        cost = None if self.step_s is None else steps * self.step_s
        allowance = self.allowance_s()
        if allowance is not None and cost is not None and self.planned_s + cost > allowance:
            self.skipped.append(what)
            return (f"not measured: its {steps} probe steps (~{cost:.0f} s) would take the auto probes past "
                    f"train.probe_budget={self.fraction:g} of this run's projected {allowance / self.fraction:.0f} s "
                    f"({self.total_steps} steps at {self.step_s:.2f} s)")
        self.planned_s += cost or 0.0
        self.measured.append(what)
        self.say(f"probing {what}: {steps} training steps" + (f" (~{cost:.0f} s)" if cost else "") + " ...",
                 flush=True)
        return None

    def line(self) -> Optional[str]:
        """The decisions block's ``probes`` line (None when nothing was probed or skipped)."""
        if not self.measured and not self.skipped:
            return None
        spent = time.perf_counter() - self.started
        parts = [f"{spent:.1f} s deciding"]
        allowance = self.allowance_s()
        if allowance is not None:
            parts.append(f"allowed {allowance:.0f} s (train.probe_budget={self.fraction:g} of {self.total_steps} "
                         f"steps at {self.step_s:.2f} s)")
        if self.measured:
            parts.append(f"measured: {', '.join(self.measured)}")
        if self.skipped:
            parts.append(f"not measured: {', '.join(self.skipped)}")
        return "; ".join(parts)

    def report(self) -> dict[str, Any]:
        """report.json ``perf.probes``."""
        return {"seconds": round(time.perf_counter() - self.started, 3), "budget_fraction": self.fraction,
                "step_s": self.step_s, "allowance_s": self.allowance_s(), "measured": list(self.measured),
                "not_measured": list(self.skipped)}

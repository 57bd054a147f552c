"""The numbers the search and ``optimize-grid`` run by: :class:`SearchSettings`, from the ``optimize`` section (tests
pass small ones), and :data:`NO_GAIN`, the prediction a candidate needs to be measured first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

NO_GAIN = 1.005
"""Candidates predicted at or above this are promising: measured first, most promising first. Those predicted below it
and at or above ``optimize.min_predicted`` are near-neutral (the cost models cannot tell them from 1.0): measured last,
while the budget lasts; below ``min_predicted`` a candidate is never measured."""


@dataclass
class SearchSettings:
    """The ``optimize`` section's numbers the search needs (tests pass small ones)."""

    budget_s: float
    rounds: int
    window_samples: int
    min_gain: float
    quality_tolerance: float
    arm_timeout_s: float
    confirm_rounds: int
    max_tries_per_value: int = 2
    max_extensions: int = 2
    """An undecided A/B (median at or above ``min_gain``, lower bound below it) gets ``rounds`` more rounds, at most
    this many times, while the candidate's time stays within a third of ``arm_timeout_s`` and the budget allows."""
    min_predicted: float = NO_GAIN
    """Candidates predicted below :data:`NO_GAIN` but at or above this are measured after every promising one, while
    the budget lasts (``optimize.min_predicted``); the default here measures none of them."""
    window_steps: int = 0
    """Each timed window holds at least this many optimizer steps of the pair's arm with the most samples per step
    (``optimize.window_steps``; 0: ``window_samples`` only) ..."""
    max_window_samples: Optional[int] = None
    """... and at most this many samples (``window_samples`` at the least): the planned run's samples ÷ ``rounds``,
    so that an A/B's timed rounds never train each arm more than the run itself does."""
    quality_samples: int = 0
    """The held-out samples of a quality read (``optimize.quality_samples``): how long one takes, before one is
    timed."""
    horizon_samples: Optional[int] = None
    """Where a candidate that changes the optimizer steps per sample is judged (``optimize.horizon_fraction`` of the
    planned run's samples); None: after :meth:`quality_samples_seen`, as every other candidate."""

    def quality_samples_seen(self) -> int:
        """The training samples every quality verdict is taken after, in the search and in ``optimize-grid``: the
        warm-up window and ``rounds`` timed windows of ``window_samples`` (± one batch per window), whatever length
        the A/B's windows take (:func:`~train.optimize.pairs.quality_point`)."""
        return (1 + self.rounds) * self.window_samples

    @classmethod
    def from_config(cls, o: Any, planned_samples: Optional[int] = None) -> "SearchSettings":
        """From the ``optimize`` section; ``planned_samples``: the run's training samples (sets the horizon)."""
        horizon = None if not planned_samples else max(1, int(o.horizon_fraction * planned_samples))
        return cls(o.budget_s, o.rounds, o.window_samples, o.min_gain, o.quality_tolerance, o.arm_timeout_s,
                   o.confirm_rounds, min_predicted=o.min_predicted, window_steps=o.window_steps,
                   max_window_samples=planned_samples // o.rounds if planned_samples else None,
                   quality_samples=o.quality_samples, horizon_samples=horizon)

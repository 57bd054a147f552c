"""The training loop's one extension protocol: four events, each a method of :class:`Callback`.

The loop (:class:`train.trainer.Trainer`) calls, for every callback in order:

* ``on_step_start(step)`` before the step's batch is fetched;
* ``on_step_end(step, step_ms) -> bool`` after the step; every callback sees every step, and the loop stops
  after this step if any returned True. ``step_ms`` is the step's duration (ms) when the host knows it: always
  on a CPU; on CUDA the loop reads step times once per logged step (no sync in between), so there it is None
  unless some callback sets ``needs_step_ms = True`` (a profiler: then every step waits for the device);
* ``on_log(record)`` after each ``metrics.jsonl`` training record (while the step's gradients are still
  in ``.grad``);
* ``on_fit_end(stats)`` once, after the last step (or the stop).

Checkpointing and clean shutdown (:class:`train.resume.Checkpointer`), gradient statistics
(:class:`train.tracking.gradstats.GradStatsCallback`) and the profilers (:mod:`train.profiling`) are callbacks;
nothing sets attributes on the trainer from outside. Modelled on Composer's event callbacks, cut to the four
events this project needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional


class Callback:
    """Override the events you need; the defaults do nothing (and never ask the loop to stop)."""

    needs_step_ms: bool = False
    """True: ``on_step_end`` needs every step's duration, so the loop waits for the device after each step."""

    def on_step_start(self, step: int) -> None:
        """Before training step ``step`` (1-based) fetches its batch."""

    def on_step_end(self, step: int, step_ms: Optional[float]) -> bool:
        """After step ``step``; ``step_ms`` in milliseconds, or None (see the module docstring). Return True to
        stop the loop after this step."""
        return False

    def on_log(self, record: dict[str, Any]) -> None:
        """After a training record (``step``, ``loss``, ``lr``, ``step_time_ms``, …) is logged."""

    def on_fit_end(self, stats: Any) -> None:
        """Once, when the loop ends (``stats``: the trainer's ``TrainStats``)."""


class AfterFirstStep(Callback):
    """Calls ``action`` once, after the first step of the loop (or at its end, when it takes no step)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action: Optional[Callable[[], None]] = action

    def _once(self) -> None:
        if self.action is not None:
            action, self.action = self.action, None
            action()

    def on_step_end(self, step: int, step_ms: Optional[float]) -> bool:
        self._once()
        return False

    def on_fit_end(self, stats: Any) -> None:
        self._once()

"""One setting of a model switched between states, the training step timed in each through the one A/B primitive.

The ``auto`` levers that change how a model computes, not what it learns (``model.fast_dropout``'s mask,
``model.packed_attention``'s path, ``model.chunked_loss``), are each decided by timing the run's own training step
with the setting one way and the other. :func:`switch_ab` is that measurement once: each arm puts the model on its
state before every step (the arms interleave, so the model changes state between consecutive steps), and the
model is put on ``restore`` afterwards, also when a step raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from train.perf.ab import ABResult, Arm, interleave

S = TypeVar("S")


def switch_ab(step: Callable[[dict], Any], batch: dict, set_state: Callable[[S], Any], states: Mapping[str, S], *,
              restore: S, rounds: int, device: torch.device) -> ABResult:
    """Time ``step(batch)`` (one training step; its result is ignored) with the model on each of ``states`` (label →
    state, in arm order: the first is warmed up first and leads round 0), through :func:`~train.perf.ab.interleave`
    with one untimed step per arm, then ``rounds`` rotated rounds of one-step windows. ``set_state(state)`` puts the
    model on a state; it runs before every step, inside the timed window, for every arm alike (the arms interleave,
    so the state must be set again each step). ``set_state(restore)`` runs last, whatever happened.

    Returns the :class:`~train.perf.ab.ABResult` with one arm per label (``ratio(a, b, "steps")``: a's steps/s ÷
    b's; ``arms[label].median_step_ms()``: ms).

    Raises:
        ValueError: from :func:`~train.perf.ab.interleave` (no states, ``rounds`` < 1); whatever a step raises.
    """
    def arm(label: str, state: S) -> Arm:
        def one() -> None:
            set_state(state)
            step(batch)

        return Arm(label, one)

    try:
        return interleave([arm(label, state) for label, state in states.items()], rounds=rounds, window=1, warmup=1,
                          device=device)
    finally:
        set_state(restore)

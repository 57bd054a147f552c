"""The schedule kept in samples: a candidate that takes other samples per optimizer step (a token budget, packed rows)
trains on the config's schedule counted in samples, with its peak learning rate scaled by a rule
(``optimize.lr_scaling``); the search's candidates and ``optimize-grid``'s combinations alike."""

from __future__ import annotations

import math
from typing import Any, Optional

SCHEDULE_KEYS = ("optim.lr", "train.max_steps", "train.eval_every", "train.checkpoint_every")
"""What :func:`schedule_in_samples` sets: the settings counted in optimizer steps, and the peak learning rate."""
LR_EXPONENT = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def schedule_in_samples(base: Any, k: float, rule: str) -> dict[str, Any]:
    """The settings of ``base`` (the config as given) for a candidate that takes ``k`` times its samples per optimizer
    step: every setting counted in steps (``train.max_steps``, ``eval_every``, ``checkpoint_every``; null stays null)
    divided by ``k`` (the step count rounded, the intervals rounded up; at least 1), so the run trains the same samples,
    warms its learning rate up over the same samples and evaluates as often; the peak ``optim.lr`` times ``k ** e`` with
    ``e`` = 0.5 for ``rule="sqrt"`` (the square-root scaling rule for adaptive optimizers: Malladi et al., "On the SDEs
    and Scaling Rules for Adaptive Gradient Algorithms", NeurIPS 2022), 1 for ``linear`` (Goyal et al. 2017, SGD), 0 for
    ``none``. ``k`` within 2 % of 1: ``base``'s own values. Returns all of :data:`SCHEDULE_KEYS`.

    Raises:
        ValueError: ``k`` ≤ 0 or an unknown ``rule``.
    """
    if not k > 0 or rule not in LR_EXPONENT:
        raise ValueError(f"schedule_in_samples: k={k!r} must be > 0 and rule={rule!r} one of {list(LR_EXPONENT)}")
    if abs(k - 1) <= 0.02:
        k = 1.0

    def steps(n: Optional[int]) -> Optional[int]:
        return None if n is None else max(1, round(n / k))

    def every(n: Optional[int]) -> Optional[int]:  # rounded up: no extra evaluation just before the final one
        return None if n is None else max(1, math.ceil(n / k - 1e-9))

    t = base.train
    return {"optim.lr": float(f"{base.optim.lr * k ** LR_EXPONENT[rule]:.4g}"), "train.max_steps": steps(t.max_steps),
            "train.eval_every": every(t.eval_every), "train.checkpoint_every": every(t.checkpoint_every)}

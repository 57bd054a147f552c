"""``train.probe_budget``: the auto probes spend at most a share of the run's projected training time. The step's
duration is forced through the clock (no test asserts what depends on the machine's speed)."""

from __future__ import annotations

import itertools

import pytest
import torch

from train.perf.probe_budget import ProbeBudget

CPU = torch.device("cpu")


def budget(fraction, steps, said=None, seconds: float = 5.0) -> ProbeBudget:
    """A budget whose timed step takes ``seconds`` by its clock (each reading ``seconds`` after the last)."""
    ticks = itertools.count()
    return ProbeBudget(fraction, steps, CPU, lambda line, **_: said.append(line) if said is not None else None,
                       clock=lambda: next(ticks) * seconds)


def test_a_probe_past_the_budget_is_not_run_and_says_why() -> None:
    ran: list[dict] = []
    said: list[str] = []
    b = budget(0.1, 30, said)  # a 5 s step (a 135M model on 2 cores), a 30-step run: 150 s, 15 s for the probes
    why = b.check("model.chunked_loss", 12, ran.append, {})
    assert len(ran) == 2 and b.step_s == pytest.approx(5.0)  # timed once (the second of two steps)
    assert why and "not measured: its 12 probe steps (~60 s)" in why and "train.probe_budget=0.1" in why
    assert b.skipped == ["model.chunked_loss"] and not said
    long = budget(0.1, 1000, said)  # a 1000-step run: 500 s for the probes
    assert long.check("model.chunked_loss", 12, ran.append, {}) is None
    assert said and said[-1].startswith("probing model.chunked_loss: 12 training steps")
    assert long.check("model.packed_attention", 100, ran.append, {}) is not None  # 12 + 100 steps > 500 s
    assert "not measured: model.packed_attention" in long.line() and "measured: model.chunked_loss" in long.line()


def test_no_budget_for_an_epoch_bound_run_or_a_null_fraction() -> None:
    ran: list[dict] = []
    for b in (budget(0.1, None), budget(None, 30)):
        assert b.check("model.chunked_loss", 12, ran.append, {}) is None
    assert ran == []  # nothing timed where there is no limit

"""``train.probe_budget``: the auto probes spend at most a share of the run's projected steps, nothing timed to
decide; the console says what is measured, the decisions block what was not."""

from __future__ import annotations

from train.perf.probe_budget import ProbeBudget


def budget(fraction, steps, said=None) -> ProbeBudget:
    return ProbeBudget(fraction, steps, lambda line, **_: said.append(line) if said is not None else None)


def test_a_probe_past_the_budget_is_not_run_and_says_why() -> None:
    said: list[str] = []
    b = budget(0.1, 30, said)  # a 30-step run: 3 probe steps
    why = b.check("model.chunked_loss", 12)
    assert why and "not measured: its 12 probe steps" in why and "train.probe_budget=0.1 of this run's 30 steps" in why
    assert b.skipped == ["model.chunked_loss"] and not said
    long = budget(0.1, 1000, said)  # a 1000-step run: 100 probe steps
    assert long.check("model.chunked_loss", 12) is None
    assert said and said[-1].startswith("probing model.chunked_loss: 12 training steps")
    assert long.check("model.packed_attention", 100) is not None  # 12 + 100 steps > 100
    assert long.check("model.packed_attention", 88) is None  # exactly the allowance
    line = long.line()
    assert "not measured: model.packed_attention" in line and "measured: model.chunked_loss" in line
    assert long.report()["probe_steps"] == 100 and long.report()["allowance_steps"] == 100.0


def test_no_budget_for_a_null_fraction_or_no_projection() -> None:
    for b in (budget(0.1, None), budget(None, 30)):
        assert b.check("model.chunked_loss", 12) is None and b.allowance_steps() is None

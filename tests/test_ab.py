"""The one A/B primitive (train/perf/ab.py): warm-up, rotated rounds, paired ratios and their interval."""

from __future__ import annotations

import pytest
import torch

from train.perf.ab import Arm, bootstrap_interval, interleave

CPU = torch.device("cpu")


def _arm(name, seconds, log, samples=10):
    it = iter(seconds) if not isinstance(seconds, (int, float)) else None

    def step():
        log.append(name)
        return {"samples": samples, "seconds": next(it) if it is not None else seconds}

    return Arm(name, step)


def test_ratio_of_known_rates_is_exact_and_a_win():
    log: list[str] = []
    res = interleave([_arm("fast", 0.5, log), _arm("slow", 1.0, log)], rounds=5, window=2, warmup=1, device=CPU)
    r = res.ratio("fast", "slow")
    assert r.median == pytest.approx(2.0) and r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)
    assert r.verdict == "faster" and r.clears(1.5) and not r.clears(2.5)
    assert res.ratio("slow", "fast").verdict == "slower"
    assert res.arms["fast"].median("samples") == pytest.approx(20.0)  # 10 samples per 0.5 s
    assert res.arms["fast"].total("steps") == 10  # warm-up steps are not counted


def test_interval_including_one_is_no_measurable_difference():
    log: list[str] = []
    a = _arm("a", [9, 1.0, 1.2, 0.8, 1.1, 0.9, 1.3, 0.7], log)  # the first value is the warm-up step
    b = _arm("b", [9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], log)
    r = interleave([a, b], rounds=7, window=1, device=CPU).ratio("a", "b")
    assert r.low < 1.0 < r.high
    assert r.verdict == "no measurable difference" and not r.clears(1.0)


def test_order_rotates_every_round_and_warmup_comes_first():
    log: list[str] = []
    arms = [_arm(n, 0.1, log) for n in ("x", "y", "z")]
    interleave(arms, rounds=3, window=1, warmup=2, device=CPU)
    assert log[:6] == ["x", "x", "y", "y", "z", "z"]
    assert log[6:] == ["x", "y", "z", "y", "z", "x", "z", "x", "y"]


def test_window_by_samples_and_measure_context():
    import contextlib

    log: list[str] = []
    entered = []

    @contextlib.contextmanager
    def measure():
        out: dict = {}
        entered.append(1)
        yield out
        out["peak"] = 7

    arm = _arm("a", 0.1, log, samples=3)
    arm.measure = measure
    res = interleave([arm], rounds=2, window_samples=10, warmup=0, device=CPU)
    w = res.arms["a"].windows[0]
    assert w.steps == 4 and w.counts["samples"] == 12 and w.extra == {"peak": 7} and len(entered) == 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        interleave([], rounds=1, device=CPU)
    log: list[str] = []
    with pytest.raises(ValueError):
        interleave([_arm("a", 1, log), _arm("a", 1, log)], rounds=1, device=CPU)
    with pytest.raises(ValueError):
        interleave([_arm("a", 1, log)], rounds=0, device=CPU)


def test_bootstrap_interval_is_seeded_and_brackets_the_median():
    vals = [1.0, 1.1, 0.9, 1.05, 1.2, 0.95]
    lo, hi = bootstrap_interval(vals)
    assert (lo, hi) == bootstrap_interval(vals)
    assert lo <= sorted(vals)[len(vals) // 2] <= hi
    assert bootstrap_interval([]) == (None, None) and bootstrap_interval([2.0]) == (None, None)
    from train.perf.ab import Ratio

    one = Ratio("a", "b", "samples", [1.5], 1.5, None, None)
    assert one.verdict == "one round: no interval" and not one.clears(1.0) and "no interval" in one.describe()


def test_synchronised_wall_time_when_an_arm_reports_none():
    import time

    res = interleave([Arm("sleep", lambda: (time.sleep(0.01), {"samples": 1})[1])], rounds=2, window=2, device=CPU)
    assert all(w.seconds >= 0.02 for w in res.arms["sleep"].windows)
    assert res.load_start is None or res.load_start >= 0


def test_a_result_written_as_json_reads_back_with_the_same_ratios():
    """What a child process measured (optimize-grid's final) comes back through JSON with every window and count."""
    import json

    from train.perf.ab import ABResult

    fast = iter([{"samples": 8, "real_tokens": 80, "seconds": s} for s in (0.1, 0.2, 0.1, 0.3)])
    slow = iter([{"samples": 8, "real_tokens": 90, "seconds": s} for s in (0.3, 0.2, 0.5, 0.4)])
    res = interleave([Arm("a", lambda: next(fast)), Arm("b", lambda: next(slow))], rounds=4, window=1, warmup=0,
                     device=torch.device("cpu"))
    back = ABResult.from_dict(json.loads(json.dumps(res.as_dict())))
    assert back.rounds == 4 and back.load_start == res.load_start
    assert back.arms["b"].windows[2].counts == {"samples": 8.0, "real_tokens": 90.0}
    for metric in ("samples", "real_tokens", "steps"):
        assert back.ratio("a", "b", metric).as_dict() == res.ratio("a", "b", metric).as_dict()
    with pytest.raises(KeyError):
        ABResult.from_dict({"rounds": 1})

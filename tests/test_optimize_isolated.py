"""optimize-grid's final in a fresh process (train/optimize/isolated.py): a real child measures the arms,
its failures and time-outs come back as one line naming its log."""

from __future__ import annotations

import pytest

from train.config import dump_config
from train.optimize.isolated import IsolatedFailure, measure_in_fresh_process


def test_a_fresh_process_measures_the_arms_and_returns_their_windows(tiny_cfg, tmp_path):
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(dump_config(tiny_cfg("train.precision=fp32")))
    arms = {"fitted": {"batching.method": "optimal"}, "padded": {"batching.method": "pad-to-max"}}
    res = measure_in_fresh_process(cfg_path, arms, rounds=2, window_samples=32, warmup_samples=16,
                                   work_dir=tmp_path / "final" / "0", timeout_s=300)
    assert set(res.arms) == {"fitted", "padded"} and res.rounds == 2
    for a in res.arms.values():
        assert [w.round for w in a.windows] == [0, 1]
        assert all(w.counts["samples"] >= 32 and w.seconds > 0 and w.steps >= 2 for w in a.windows)
    # pad-to-max pads every row to data.max_len: more padded tokens per sample than fitted buckets
    per = {n: a.total("padded_tokens") / a.total("samples") for n, a in res.arms.items()}
    assert per["padded"] == pytest.approx(32) and per["fitted"] < per["padded"]
    assert res.ratio("fitted", "padded").median is not None
    assert (tmp_path / "final" / "0" / "result.json").is_file()
    assert "round 2/2" in (tmp_path / "final" / "0" / "child.log").read_text()


def test_a_failing_child_is_one_line_naming_its_log(tiny_cfg, tmp_path):
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(dump_config(tiny_cfg()))
    with pytest.raises(IsolatedFailure, match=r"child\.log: exit code 2: .*batching\.method"):
        measure_in_fresh_process(cfg_path, {"bad": {"batching.method": "nonsense"}}, rounds=2, window_samples=8,
                                 warmup_samples=8, work_dir=tmp_path / "w", timeout_s=300)
    with pytest.raises(IsolatedFailure, match=r"child\.log: ran past 0 s"):
        measure_in_fresh_process(cfg_path, {"a": {}}, rounds=2, window_samples=8, warmup_samples=8,
                                 work_dir=tmp_path / "w2", timeout_s=0.2)

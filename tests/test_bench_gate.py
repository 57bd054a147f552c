"""The performance regression gate (train/bench/gate.py): the comparison rules, and end to end on fixture data a
deliberate regression (``optimized`` forced to pad every batch to ``data.max_len``) fails the gate with exit code 1."""

from __future__ import annotations

import json

import pytest

from tests.ddp_helpers import tiny_overrides
from train.bench import training
from train.bench.gate import compare, figures
from train.cli import main


def _row(name: str, sps: float, eff: float = 0.9, shapes: int = 3) -> dict:
    return {"name": name, "samples_per_s": sps, "token_efficiency": eff, "distinct_shapes": shapes,
            "samples_per_step_mean": 32.0, "samples_per_epoch": 100, "precision": "fp32"}


def _baseline(rows: list[dict], band: float = 0.15) -> dict:
    return {**figures(rows, "fp"), "ratio_band": band, "absolute_allowed": False, "device": "cpu"}


def test_ratios_within_the_band_pass_and_a_slower_ratio_fails() -> None:
    base = _baseline([_row("naive", 100), _row("hf-style", 200), _row("optimized", 300)])
    same_speed_noisy = figures([_row("naive", 110), _row("hf-style", 205), _row("optimized", 290)], "fp")
    assert all(c.ok for c in compare(base, same_speed_noisy))
    slower = figures([_row("naive", 100), _row("hf-style", 200), _row("optimized", 240)], "fp")  # 3.0x → 2.4x
    failed = {c.name for c in compare(base, slower) if not c.ok}
    assert failed == {"optimized/naive", "optimized/hf-style"}


def test_absolute_times_are_ignored_on_a_cpu_baseline_but_exact_figures_are_not() -> None:
    base = _baseline([_row("naive", 100), _row("optimized", 300)])
    everything_slower = figures([_row("naive", 10), _row("optimized", 30)], "fp")  # a loaded machine: same ratio
    assert all(c.ok for c in compare(base, everything_slower, "cpu"))
    other_padding = figures([_row("naive", 100), _row("optimized", 300, eff=0.8)], "fp")
    assert [c.name for c in compare(base, other_padding) if not c.ok] == ["optimized.token_efficiency"]


def test_each_ratio_has_its_own_band() -> None:
    base = {**_baseline([_row("naive", 100), _row("hf-style", 200), _row("optimized", 300)]),
            "ratio_band": {"optimized/naive": 0.1, "optimized/hf-style": 0.5, "hf-style/naive": 0.5}}
    now = figures([_row("naive", 100), _row("hf-style", 200), _row("optimized", 255)], "fp")  # optimized −15%
    assert {c.name for c in compare(base, now) if not c.ok} == {"optimized/naive"}


def test_other_data_or_precision_is_refused_not_compared() -> None:
    base = _baseline([_row("naive", 100), _row("optimized", 300)])
    now = figures([{**_row("naive", 100), "precision": "bf16"}, _row("optimized", 300)], "other")
    failed = {c.name for c in compare(base, now) if not c.ok}
    assert {"data fingerprint", "precision per row"} <= failed


def test_a_gpu_baseline_also_gates_absolute_throughput_on_the_same_device() -> None:
    base = {**_baseline([_row("naive", 100), _row("optimized", 300)]), "absolute_allowed": True, "device": "H200"}
    slower = figures([_row("naive", 50), _row("optimized", 150)], "fp")
    assert {c.name for c in compare(base, slower, "H200") if not c.ok} == {"naive.samples_per_s", "optimized.samples_per_s"}
    assert all(c.ok for c in compare(base, slower, "A100"))  # another GPU: ratios only


@pytest.mark.parametrize("regress", [False, True])
def test_gate_end_to_end_and_a_deliberate_regression_fails(regress, wndb, tmp_path, monkeypatch, capsys) -> None:
    args = [*tiny_overrides(wndb, tmp_path, "bench.warmup_steps=1", "bench.rounds=3", "bench.window=2",
                            "batching.max_tokens=256", "data.max_len=32"),
            f"bench_gate.baseline={tmp_path / 'baseline.json'}",
            "bench_gate.band_floor=0.9"]  # millisecond steps on a shared CPU: this test is about the plumbing and the
    # exact figures; the ratio rule has its own tests above
    assert main(["bench-baseline", *args, "bench_gate.repeats=2"]) == 0
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    assert len(baseline["measured"]["ratios_each_run"]["optimized/naive"]) == 2
    assert all(b >= 0.9 for b in baseline["ratio_band"].values())
    if regress:  # the lever silently lost: optimized pads every batch to data.max_len
        row = training.CONFIGS["optimized"]
        monkeypatch.setitem(training.CONFIGS, "optimized",
                            training.BenchRow(row.overrides + ("batching.method=pad-to-max",), row.parent, row.lever))
    capsys.readouterr()
    code = main(["bench-gate", *args])
    out = capsys.readouterr().out
    assert code == (1 if regress else 0), out
    assert ("REGRESSION" in out) == regress and "| optimized.token_efficiency | exact |" in out
    if regress:
        assert "✗" in out.split("| optimized.token_efficiency |")[1].splitlines()[0]
    result = json.loads(next((tmp_path / "runs").glob("bench-gate-*/bench-gate.json")).read_text())
    assert result["passed"] is (not regress)


def test_gate_without_a_baseline_is_one_line_and_writes_nothing(wndb, tmp_path, capsys) -> None:
    code = main(["bench-gate", *tiny_overrides(wndb, tmp_path), f"bench_gate.baseline={tmp_path / 'none.json'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "make bench-baseline" in err
    assert not (tmp_path / "runs").exists()

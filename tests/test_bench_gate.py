"""The performance regression gate (train/bench/gate.py): the comparison rules, and end to end on fixture
data a deliberate regression (``optimized`` forced to pad every batch to ``data.max_len``) fails the gate with exit
code 1."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_overrides
from train.bench import rows
from train.bench.gate import changes, compare, figures
from train.cli import main


def _row(name: str, sps: float, eff: float = 0.9, shapes: int = 3) -> dict:
    return {"name": name, "samples_per_s": sps, "token_efficiency": eff, "distinct_shapes": shapes,
            "samples_per_step_mean": 32.0, "samples_per_epoch": 100, "precision": "fp32"}


HERE = "cpu:Test CPU|avx2|2c|2t"


def _baseline(rows: list[dict], band: float = 0.15, **entry) -> dict:
    f = figures(rows, "fp")
    timing = {"ratios": f["ratios"], "absolute": f["absolute"], "absolute_allowed": False, "device": "cpu",
              "ratio_band": {k: band for k in f["ratios"]}, **entry}
    return {"data_fingerprint": f["data_fingerprint"], "precision": f["precision"], "exact": f["exact"],
            "machines": {HERE: timing}}


def test_ratios_within_the_band_pass_and_a_slower_ratio_fails() -> None:
    base = _baseline([_row("naive", 100), _row("hf-style", 200), _row("optimized", 300)])
    same_speed_noisy = figures([_row("naive", 110), _row("hf-style", 205), _row("optimized", 290)], "fp")
    assert all(c.ok for c in compare(base, same_speed_noisy, HERE))
    slower = figures([_row("naive", 100), _row("hf-style", 200), _row("optimized", 240)], "fp")  # 3.0x → 2.4x
    failed = {c.name for c in compare(base, slower, HERE) if not c.ok}
    assert failed == {"optimized/naive", "optimized/hf-style"}


def test_absolute_times_are_ignored_on_a_cpu_baseline_but_exact_figures_are_not() -> None:
    base = _baseline([_row("naive", 100), _row("optimized", 300)])
    everything_slower = figures([_row("naive", 10), _row("optimized", 30)], "fp")  # a loaded machine: same ratio
    assert all(c.ok for c in compare(base, everything_slower, HERE, "cpu"))
    other_padding = figures([_row("naive", 100), _row("optimized", 300, eff=0.8)], "fp")
    assert [c.name for c in compare(base, other_padding, HERE) if not c.ok] == ["optimized.token_efficiency"]


def test_each_ratio_has_its_own_band() -> None:
    base = _baseline([_row("naive", 100), _row("hf-style", 200), _row("optimized", 300)],
                     ratio_band={"optimized/naive": 0.1, "optimized/hf-style": 0.5, "hf-style/naive": 0.5})
    now = figures([_row("naive", 100), _row("hf-style", 200), _row("optimized", 255)], "fp")  # optimized −15%
    assert {c.name for c in compare(base, now, HERE) if not c.ok} == {"optimized/naive"}


def test_timing_is_gated_only_against_the_same_kind_of_machine_exact_figures_everywhere() -> None:
    base = _baseline([_row("naive", 100), _row("optimized", 300)])
    half_as_fast = figures([_row("naive", 100), _row("optimized", 150)], "fp")  # 3.0x → 1.5x
    assert {c.name for c in compare(base, half_as_fast, HERE) if not c.ok} == {"optimized/naive"}
    elsewhere = compare(base, half_as_fast, "cpu:Other CPU|avx2,avx512f|2c|2t")
    ratio = [c for c in elsewhere if c.kind == "ratio"]
    assert ratio and all(c.ok and c.allowed == "not gated" and "no timing baseline" in c.note for c in ratio)
    other_padding = figures([_row("naive", 100), _row("optimized", 150, eff=0.8)], "fp")
    assert [c.name for c in compare(base, other_padding, "cpu:Other CPU|avx2|2c|2t") if not c.ok] == \
        ["optimized.token_efficiency"]


def test_other_data_or_precision_is_refused_not_compared() -> None:
    base = _baseline([_row("naive", 100), _row("optimized", 300)])
    now = figures([{**_row("naive", 100), "precision": "bf16"}, _row("optimized", 300)], "other")
    failed = {c.name for c in compare(base, now, HERE) if not c.ok}
    assert {"data fingerprint", "precision per row"} <= failed


def test_a_gpu_baseline_also_gates_absolute_throughput_on_the_same_device() -> None:
    base = _baseline([_row("naive", 100), _row("optimized", 300)], absolute_allowed=True, device="H200")
    base["machines"] = {"cuda:H200": base["machines"][HERE]}
    slower = figures([_row("naive", 50), _row("optimized", 150)], "fp")
    assert {c.name for c in compare(base, slower, "cuda:H200", "H200") if not c.ok} == \
        {"naive.samples_per_s", "optimized.samples_per_s"}
    assert all(c.ok for c in compare(base, slower, "cuda:A100", "A100"))  # another GPU: not gated on timing


@pytest.mark.parametrize("regress", [False, True])
def test_gate_end_to_end_and_a_deliberate_regression_fails(regress, wndb, tmp_path, monkeypatch, capsys) -> None:
    args = [*tiny_overrides(wndb, tmp_path, "bench.warmup_steps=1", "bench.rounds=3", "bench.window=2",
                            "batching.max_tokens=256", "data.max_len=32"),
            f"bench_gate.baseline={tmp_path / 'baseline.json'}",
            "bench_gate.band_floor=0.9"]  # millisecond steps on a shared CPU: this test is about the plumbing and the
    # exact figures; the ratio rule has its own tests above
    assert main(["bench-baseline", *args, "bench_gate.repeats=2"]) == 0
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    (entry,) = baseline["machines"].values()  # this machine's timing entry
    assert len(entry["measured"]["ratios_each_run"]["optimized/naive"]) == 2
    assert all(b >= 0.9 for b in entry["ratio_band"].values())
    if regress:  # the lever silently lost: optimized pads every batch to data.max_len
        row = rows.CONFIGS["optimized"]
        monkeypatch.setitem(rows.CONFIGS, "optimized",
                            rows.BenchRow(row.overrides + ("batching.method=pad-to-max",), row.parent, row.lever))
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


def test_changes_name_the_machine_entry_and_every_figure_that_moved() -> None:
    old = _baseline([_row("naive", 100), _row("optimized", 300)])
    new = _baseline([_row("naive", 100), _row("optimized", 330, eff=0.95)])
    lines = changes(old, new, HERE)
    assert any("exact optimized.token_efficiency: 0.9 → 0.95" in x for x in lines)
    assert any("ratios optimized/naive: 3 → 3.3" in x for x in lines)
    other = {**new, "machines": {"cpu:Other|avx2|2c|2t": new["machines"][HERE]}}
    assert "a new machine entry: cpu:Other|avx2|2c|2t" in changes(old, other, "cpu:Other|avx2|2c|2t")[0]

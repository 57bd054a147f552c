"""bench-precision on tiny data: same batches, the auto row (fp32 here) identical to fp32, files written."""

import json
from pathlib import Path

import pytest
import torch

from train.bench.precision_modes import run_precision_bench


def test_bench_precision_small(tiny_cfg) -> None:
    out = run_precision_bench(tiny_cfg("train.run_id=bp", "bench_precision.steps=6", "bench_precision.bf16_cpu_steps=2",
                             "bench_precision.warmup=1"))
    run_dir = Path(out["run_dir"])
    on_disk = json.loads((run_dir / "bench-precision.json").read_text())
    rows = {r["requested"]: r for r in on_disk["rows"]}
    assert rows["fp32"]["precision"] == "fp32" and rows["fp32"]["eval_accuracy"] is not None
    if torch.cuda.is_available():
        return
    assert set(rows) == {"fp32", "auto", "bf16"}
    auto = rows["auto"]
    if auto["precision"] == "fp32":  # this CPU: auto must be exactly fp32, not merely close
        assert auto["identical_to_fp32"] is True and auto["loss_gap_vs_fp32"]["max_abs"] == 0.0
        assert auto["eval_accuracy"] == rows["fp32"]["eval_accuracy"]
    bf16 = rows["bf16"]
    assert bf16["precision"] == "bf16" and bf16["steps"] == 2 and bf16["eval_accuracy"] is None
    assert "timing-only" in bf16["eval_unavailable_reason"] and bf16["step_time_ms_p50"] > 0
    # timed steps only (after warm-up): bf16's one timed step is step 2, and so is fp32's first (warm-up 1)
    assert len(bf16["step_times_ms"]) == 1 and len(rows["fp32"]["step_times_ms"]) == 5
    fp32_same_step = rows["fp32"]["step_times_ms"][0]
    assert bf16["step_time_ratio_vs_fp32"] == bf16["step_times_ms"][0] / fp32_same_step
    s = bf16["speedup_vs_fp32"]  # the paired ratio with its interval, from the one A/B primitive
    assert s["per_round"] == pytest.approx([fp32_same_step / bf16["step_times_ms"][0]])
    assert s["low"] is None and s["verdict"] == "one round: no interval"  # one timed step supports no claim
    auto_s = rows["auto"]["speedup_vs_fp32"]
    assert len(auto_s["per_round"]) == 5 and auto_s["low"] <= auto_s["median"] <= auto_s["high"]
    assert rows["fp32"]["speedup_vs_fp32"] is None
    assert rows["fp32"]["peak_memory_bytes"] is None and rows["fp32"]["peak_memory_unavailable_reason"]
    md = (run_dir / "bench-precision.md").read_text()
    assert "| auto | " in md and "| bf16 | bf16 | 2 |" in md

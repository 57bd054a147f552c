"""`python -m train compare` on two real small runs; clear exit-2 errors; `wandb-sync` with nothing to sync."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from train.cli import main
from train.run.training import run_training


def test_compare_two_runs_writes_table_and_plot(tiny_cfg, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = run_training(tiny_cfg("train.max_steps=6", "train.log_every=2", "train.run_id=a"), time.perf_counter())
    b = run_training(tiny_cfg("train.max_steps=6", "train.log_every=2", "train.run_id=b", "batching.method=pad-to-max"),
                     time.perf_counter())
    out = tmp_path / "cmp"
    assert main(["compare", a["run_dir"], "b", "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "| metric | a | b |" in stdout and "| batching method | optimal | pad-to-max |" in stdout
    md = (out / "compare.md").read_text()
    eff = next(line for line in md.splitlines() if line.startswith("| token efficiency"))
    assert f"{a['batching']['token_efficiency']:.3f}" in eff and f"{b['batching']['token_efficiency']:.3f}" in eff
    tput = next(line for line in md.splitlines() if line.startswith("| throughput (samples/s)"))
    assert "(×" in tput  # ratio against the first run
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_compare_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert "run directory" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    assert main(["compare", str(tmp_path / "half")]) == 2
    assert "has no report.json" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "report.json").write_text("{}")
    (tmp_path / "bad" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n{oops\n")
    assert main(["compare", str(tmp_path / "bad"), "--out", str(tmp_path / "o")]) == 2
    assert "metrics.jsonl:2: malformed JSON" in capsys.readouterr().err


def test_wandb_sync_nothing_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["wandb-sync", "--runs-dir", str(tmp_path)]) == 0
    assert "nothing to sync" in capsys.readouterr().out
    run = tmp_path / "r1" / "wandb" / "offline-run-20260101_000000-abc"
    run.mkdir(parents=True)
    assert main(["wandb-sync", "--runs-dir", str(tmp_path), "--dry-run"]) == 0
    assert str(run) in capsys.readouterr().out
    (run / "run-abc.wandb.synced").write_text("")
    assert main(["wandb-sync", "--runs-dir", str(tmp_path)]) == 0
    assert "nothing to sync" in capsys.readouterr().out


def test_two_bench_json_files_compare_machines_and_ratios(tmp_path) -> None:
    from train.cli import main

    def bench(path, sps, flags, load):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"env": {"device": "cpu (X)", "cpu_flags": flags, "torch": "2.1.0", "num_threads": 2,
                                            "load_1min": load, "load_1min_at_end": load},
                                    "training": {"configs": [{"name": "naive", "samples_per_s": sps},
                                                             {"name": "optimized", "samples_per_s": 4 * sps}]}}))
        return str(path)

    a = bench(tmp_path / "a" / "bench.json", 100.0, ["avx2"], 0.3)
    bench(tmp_path / "b" / "bench" / "bench.json", 150.0, ["avx2", "avx512_bf16"], 0.9)
    assert main(["compare", a, str(tmp_path / "b"), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "compare_bench.md").read_text()
    assert "| naive | 100.0 | 150.0 | 1.50 |" in md and "| optimized | 400.0 | 600.0 | 1.50 |" in md
    assert "avx2, avx512_bf16" in md and "0.30 / 0.30" in md

"""A short real ``python -m train optimize`` on tiny data: the outputs exist, are valid, and say what was decided;
``optimized.yaml`` loads and holds the chosen settings; bad input is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.progress=false", "data.max_samples=600", "data.vocab_size=300", "data.max_len=32",
        "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.ffn_size=64",
        "batching.batch_size=16", "optimize.budget_s=60", "optimize.rounds=2", "optimize.window_samples=32",
        "optimize.confirm_rounds=2", "optimize.quality_samples=32", "optimize.profile_steps=2"]


def _optimize(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", "optimize", "--config", "configs/naive-cpu.yaml",
                           "--run-id", "opt", f"train.output_dir={tmp_path / 'runs'}",
                           f"data.cache_dir={tmp_path / 'cache'}", *TINY, *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_short_real_optimize_run_writes_a_complete_report(tmp_path):
    p = _optimize(tmp_path, "optimize.levers=batching,fast_dropout,workers")
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "runs" / "opt" / "optimize"
    res = json.loads((out / "optimize.json").read_text())
    assert res["status"] in ("completed", "budget")
    assert res["decisions"], res
    assert res["profiles"][0]["padding_share"] is not None
    for d in res["decisions"]:
        assert d["lever"] in ("batching", "fast_dropout", "workers")
        if d["accepted"]:
            assert d["ratio"]["low"] >= 1.02
        else:
            assert d["reason"]
    assert set(res["not_applicable"]) <= {"batching", "fast_dropout", "workers"}
    best = load_config(str(out / "optimized.yaml"))
    for key, value in res["best"].items():
        section, name = key.split(".")
        assert getattr(getattr(best, section), name) == value
    assert best.train.run_id is None and best.data.max_len == 32
    md = (out / "optimize.md").read_text()
    assert "## Decisions, in order" in md and "make train CONFIG=" in md
    if any(d["accepted"] for d in res["decisions"]):
        assert (out / "waterfall.png").stat().st_size > 1000
    assert (out / "profiles" / "0" / "summary.json").is_file()
    assert "optimize: " in p.stdout and "optimized.yaml" in p.stdout


def test_an_unknown_lever_is_one_line_exit_2(tmp_path):
    p = _optimize(tmp_path, "optimize.levers=precision,warp-drive")
    assert p.returncode == 2
    assert p.stderr.strip() == ("error: optimize.levers: unknown lever(s) ['warp-drive']; choose from precision, "
                                "batching, token_budget, attention, fast_dropout, chunked_loss, fused_adamw, workers, "
                                "threads, compile, allocator")
    assert not (tmp_path / "runs" / "opt").exists()

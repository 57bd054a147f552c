"""A short real ``python -m train optimize`` on tiny data: the outputs exist, are valid, and say what was decided;
``optimized.yaml`` loads and holds the chosen settings; bad input is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from train.cli import main
from train.config import load_config
from train.errors import UserError
from train.optimize import run_optimize
from train.optimize.command import baseline_settings, optimized_settings
from train.optimize.preflight import Capabilities, refuse_inapplicable
from train.optimize.proposals import Candidate
from train.optimize.results import Decision

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
    measured = {key for d in res["decisions"] for key in d["overrides"]}
    assert res["baseline"].get("model.packed_attention") == "sdpa-mask"  # the config's auto, pinned for the arms
    for key, value in res["best"].items():  # an auto the baseline pinned and no candidate measured stays auto
        unmeasured = key in res["baseline"] and key not in measured and value == res["baseline"][key]
        assert best.value(key) == ("auto" if unmeasured else value), key
    assert best.model.packed_attention == "auto"
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
                                "batching, token_budget, attention, fast_dropout, chunked_loss, checkpoint_blocks, "
                                "fused_adamw, workers, threads, compile, allocator")
    assert not (tmp_path / "runs" / "opt").exists()


def _never(*_args, **_kwargs):
    raise AssertionError("measured or wrote something before the refusal")


def test_a_named_lever_that_cannot_apply_is_refused_before_anything_is_measured_or_written(
        wndb, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: False)  # forced: a CPU without native bf16
    monkeypatch.setattr("train.optimize.command.start_run", _never)  # the run directory, the precision
    monkeypatch.setattr("train.optimize.command.search", _never)
    rc = main(["optimize", *tiny_overrides(wndb, tmp_path, "model.dropout=0.0", "train.run_id=opt",
                                           "optimize.levers=fast_dropout,precision,workers")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: optimize.levers=fast_dropout,precision,workers: cannot apply here — fast_dropout: "
                          "the model (model.source=builtin) has no nn.Dropout module with p > 0")
    assert "; precision: this CPU has no native bf16" in err and "; workers" not in err
    assert not (tmp_path / "runs").exists()


class _Reached(Exception):
    pass


def test_the_same_levers_pass_where_they_apply(tiny_cfg, monkeypatch):
    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: True)  # forced: native bf16
    monkeypatch.setattr("train.optimize.command.start_run", lambda *_a, **_k: (_ for _ in ()).throw(
        _Reached()))
    with pytest.raises(_Reached):  # past the check, at the run's start
        run_optimize(tiny_cfg("model.dropout=0.1", "optimize.levers=fast_dropout,precision"), notice=lambda _m: None)


@pytest.mark.parametrize("lever,overrides,caps,says", [
    ("chunked_loss", [], Capabilities(), "model.task=classification has logits [N, classes]"),
    ("attention", [], Capabilities(True, 0, {"flex": ""}), "batching.method=optimal: the path is packed rows'"),
    ("attention", ["batching.method=packed"], Capabilities(True, 0, {}), "no other packed-rows path"),
    ("allocator", [], Capabilities(), "nothing to set on cpu"),
])
def test_each_check_names_why_its_lever_cannot_apply(lever, overrides, caps, says):
    cfg = load_config(None, overrides)
    with pytest.raises(UserError, match=f"cannot apply here — {lever}: .*{says}".replace("[", r"\[").replace(
            "]", r"\]")):
        refuse_inapplicable([lever], cfg, caps, torch.device("cpu"))
    if lever == "attention" and not overrides:  # the batching lever may switch packing on: then it may apply
        refuse_inapplicable(["batching", lever], cfg, caps, torch.device("cpu"))


def test_optimized_yaml_keeps_auto_for_what_no_candidate_measured():
    pinned = {"train.precision": "fp32", "batching.method": "optimal", "model.packed_attention": "sdpa-mask"}
    best = {**pinned, "optim.fused": True}
    tried = [Decision(Candidate("precision", "bf16", {"train.precision": "bf16"}, 1.5, "e", "numerics"), False, "r"),
             Decision(Candidate("fused_adamw", "true", {"optim.fused": True}, 1.1, "e", "numerics"), True, "")]
    assert optimized_settings(best, pinned, tried) == {"train.precision": "fp32", "optim.fused": True}
    assert optimized_settings({**best, "batching.method": "packed"}, pinned, [])["batching.method"] == "packed"
    cfg = load_config(None, ["model.fast_dropout=auto"])
    assert "the baseline runs nn.Dropout" in " ".join(baseline_settings(cfg, "fp32")[1])
    notes = " ".join(baseline_settings(cfg, "fp32", dropout=False)[1])  # a model without dropout: nothing to swap
    assert "nn.Dropout with p > 0 (nothing to swap)" in notes and "the baseline runs nn.Dropout" not in notes

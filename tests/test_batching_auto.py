"""batching.method=auto: the measured choice between packed rows and optimal buckets (train/data/batching_auto.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from train.data import batching_auto, prepare_data
from train.data.batching_auto import apply_batching, choose_batching, measure_layouts
from train.precision import PrecisionPolicy
from train.run.training import run_training
from train.setup import build_model, probe_steps


def _setup(tiny_cfg, *overrides):
    cfg = tiny_cfg("batching.method=auto", *overrides)
    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    model = build_model(cfg, bundle)
    return cfg, bundle, model, PrecisionPolicy.for_config(cfg, torch.device("cpu"))


def _probe(model, policy, cfg):
    return lambda: probe_steps(cfg, model, policy, torch.device("cpu"))


def _forced(ratio: float):
    calls = []

    def measure(*args, **kwargs):
        calls.append(1)
        return {"ratio": ratio, "repeats": 2, "packed": {"samples_per_s": 100.0 * ratio, "token_efficiency": 0.99},
                "buckets": {"samples_per_s": 100.0, "token_efficiency": 0.88, "bounds": [8, 16, 32]}}
    return measure, calls


@pytest.mark.parametrize("ratio,want", [(1.25, "packed"), (0.8, "optimal")])
def test_auto_picks_the_faster_layout_says_why_and_caches_it(tiny_cfg, ratio, want, monkeypatch) -> None:
    monkeypatch.setattr(batching_auto, "machine_load", lambda: 0.0)  # a quiet machine: the decision is cached
    cfg, bundle, model, policy = _setup(tiny_cfg)
    measure, calls = _forced(ratio)
    d = choose_batching(model, policy, cfg, bundle, torch.device("cpu"), _probe(model, policy, cfg), measure)
    assert d.method == want and d.source == "measured" and f"{ratio:.2f}x" in d.reason and d.reason.endswith(want)
    again = choose_batching(model, policy, cfg, bundle, torch.device("cpu"), _probe(model, policy, cfg), measure)
    assert again.method == want and again.source == "cached" and len(calls) == 1
    assert json.loads(Path(again.cache_path).read_text())["method"] == want


def test_auto_on_a_busy_machine_measures_again(tiny_cfg, monkeypatch) -> None:
    monkeypatch.setattr(batching_auto, "machine_load", lambda: 1e6)
    monkeypatch.setattr("train.tools.decisions.cpu_used_elsewhere", lambda: 1e6)  # and still busy at its end
    cfg, bundle, model, policy = _setup(tiny_cfg)
    measure, calls = _forced(1.5)
    for _ in range(2):
        d = choose_batching(model, policy, cfg, bundle, torch.device("cpu"), _probe(model, policy, cfg), measure)
        assert d.method == "packed" and "not cached" in d.reason
    assert len(calls) == 2


def test_auto_gives_buckets_by_rule_to_a_model_that_cannot_pack(tiny_cfg) -> None:
    cfg, bundle, model, policy = _setup(tiny_cfg)
    model.supports_packing = False
    measure, calls = _forced(9.0)
    d = choose_batching(model, policy, cfg, bundle, torch.device("cpu"), _probe(model, policy, cfg), measure)
    assert d.method == "optimal" and d.source == "rule" and "cannot run packed rows" in d.reason and not calls


def test_measure_layouts_times_real_batches_and_leaves_no_trace(tiny_cfg) -> None:
    cfg, bundle, model, policy = _setup(tiny_cfg, "model.dropout=0.1")
    rng = torch.get_rng_state()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with probe_steps(cfg, model, policy, torch.device("cpu")) as step:
        m = measure_layouts(step, cfg, bundle, list(bundle.bounds), torch.device("cpu"), repeats=2)
    assert torch.equal(torch.get_rng_state(), rng), "the run's dropout stream is untouched"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), "training steps, then restored"
    assert all(p.grad is None for p in model.parameters())
    assert m["ratio_interval"][0] <= m["ratio_interval"][1]
    for layout in ("buckets", "packed"):
        assert m[layout]["samples_per_s"] > 0 and 0 < m[layout]["token_efficiency"] <= 1
        assert all(ms > 0 for ms in m[layout]["step_ms"].values())
    assert len(m["buckets"]["step_ms"]) <= len(bundle.bounds) and len(m["packed"]["step_ms"]) == 1
    assert m["packed"]["token_efficiency"] > m["buckets"]["token_efficiency"]  # packing pads less than 3 buckets
    assert m["ratio"] == pytest.approx(m["packed"]["samples_per_s"] / m["buckets"]["samples_per_s"])


def test_apply_batching_replans_the_bundle_for_packed_rows(tiny_cfg) -> None:
    cfg, bundle, _, _ = _setup(tiny_cfg)
    assert bundle.plan is not None and bundle.pad_to == "bound"  # auto plans optimal buckets first
    packed_cfg, packed = apply_batching(cfg, bundle, "packed")
    assert packed_cfg.batching.method == "packed" and packed.bounds == [cfg.data.max_len] and packed.plan is None
    assert cfg.batching.method == "auto", "the loaded config is left as it is: a decision makes a new one"
    optimal_cfg, same = apply_batching(cfg, bundle, "optimal")
    assert same is bundle and optimal_cfg.batching.method == "optimal"


@pytest.mark.parametrize("ratio,want", [(2.0, "packed"), (0.5, "optimal")])
def test_train_with_auto_runs_the_chosen_method_and_reports_it(tiny_cfg, ratio, want, monkeypatch) -> None:
    measure, _ = _forced(ratio)
    monkeypatch.setattr(batching_auto, "measure_layouts", measure)
    report = run_training(tiny_cfg("batching.method=auto", "train.max_steps=8", f"train.run_id=auto-{want}"),
                          time.perf_counter())
    b = report["batching"]
    assert b["method"] == want and b["auto"]["requested"] == "auto" and b["auto"]["chosen"] == want
    assert ("rows_per_step" in b) == (want == "packed")
    saved = yaml.safe_load((Path(report["run_dir"]) / "config.yaml").read_text())
    assert saved["batching"]["method"] == want, "config.yaml keeps the choice, so --resume replays it"

"""model.fast_dropout (train/models/dropout.py): the same distribution (p to 2^-16), exact scaling, every lane of
a draw uniform, eval untouched, the swap, the measured decision, and exact resume."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import assert_same_final_state, tiny_overrides
from train.config import load_config
from train.models.dropout import FastDropout, decide_fast_dropout, keep_mask, quantized_p, set_fast_dropout, unswappable
from train.resume import list_checkpoints
from train.run.training import run_training

CPU = torch.device("cpu")


@pytest.mark.parametrize("p,dtype", [(0.1, torch.float32), (0.3, torch.bfloat16), (0.5, torch.bfloat16)])
def test_keep_rate_and_scaling_are_dropouts(p, dtype) -> None:
    torch.manual_seed(0)
    n = 200_000
    x = torch.ones(n, dtype=dtype)
    y = FastDropout(p).train()(x)
    assert y.dtype == dtype
    q = quantized_p(p)
    assert abs(q - p) <= 2 ** -17 and q * 65536 == round(q * 65536)
    kept = int((y != 0).sum())
    sigma = math.sqrt(n * q * (1 - q))  # binomial: kept ~ B(n, 1 - p')
    assert abs(kept - n * (1 - q)) < 5 * sigma, (kept, n * (1 - q))
    scale = (torch.ones((), dtype=dtype) * (1.0 / (1.0 - q)))
    assert torch.equal(y[y != 0], torch.full((kept,), float(scale), dtype=dtype)), "kept values scaled by 1 / (1 - p')"
    m = FastDropout(p).eval()
    assert m(x) is x, "eval mode: identity"
    assert FastDropout(0.0).train()(x) is x
    with pytest.raises(ValueError):
        FastDropout(1.0)


def test_every_16_bit_lane_of_a_draw_keeps_at_the_same_rate() -> None:
    """Four mask elements share one int64 draw: each lane must be uniform over all 2^16 values (int64 ``random_()``
    without the full range leaves the top lane 15 bits, which keeps it always at p < 0.5)."""
    torch.manual_seed(1)
    p, n = 0.1, 400_000
    lanes = keep_mask(torch.Size([n // 4, 4]), p, CPU).double().mean(0)  # element 4i + j comes from lane j of word i
    sigma = math.sqrt(p * (1 - p) / (n // 4))
    assert all(abs(float(r) - (1 - quantized_p(p))) < 5 * sigma for r in lanes), lanes
    assert keep_mask(torch.Size([3, 5, 7]), p, CPU).shape == (3, 5, 7), "odd sizes: the draw is cut to the shape"


def test_expectation_is_the_input_and_gradients_use_the_same_mask() -> None:
    torch.manual_seed(2)
    x = torch.full((100_000,), 2.0, requires_grad=True)
    y = FastDropout(0.1).train()(x)
    assert abs(float(y.detach().mean()) - 2.0) < 5 * 2.0 * math.sqrt(0.1 / 0.9 / 100_000), "unbiased: E[y] = x"
    y.sum().backward()
    assert torch.equal(x.grad != 0, y != 0), "the backward drops what the forward dropped"


def test_swap_and_back_and_what_cannot_be_swapped(tiny_cfg) -> None:
    from train.data import prepare_data
    from train.setup import build_model

    model = build_model(tiny_cfg("model.dropout=0.1"), prepare_data(tiny_cfg(), None, notice=lambda *a, **k: None))
    n = sum(type(m) is nn.Dropout for m in model.modules())
    assert n > 0 and set_fast_dropout(model, True) == n and not any(type(m) is nn.Dropout for m in model.modules())
    assert all(m.p == 0.1 for m in model.modules() if isinstance(m, FastDropout))
    assert set_fast_dropout(model, False) == n and sum(type(m) is nn.Dropout for m in model.modules()) == n
    assert any("scaled_dot_product_attention" in line for line in unswappable(model))


def _forced(speedup, low, high):
    calls = []

    def measure(model, step, batch, device):
        calls.append(1)
        return {"speedup": speedup, "low": low, "high": high, "verdict": "x", "rounds": 5, "torch_ms": 10.0,
                "fast_ms": 10.0 / speedup}
    return measure, calls


@pytest.mark.parametrize("low,want", [(1.05, True), (0.97, False)])
def test_auto_swaps_only_on_a_measurable_gain_and_caches(tiny_cfg, monkeypatch, low, want, tmp_path) -> None:
    from train.models import dropout

    monkeypatch.setattr(dropout, "machine_load", lambda: 0.0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    measure, calls = _forced(1.1, low, 1.2)
    args = (model, "auto", "fp32", str(tmp_path), lambda: batch, CPU, contextlib.nullcontext)
    first = decide_fast_dropout(*args, measure_fn=measure)
    assert (first["applied"], first["source"], len(calls)) == (want, "measured", 1) and "[" in first["reason"]
    again = decide_fast_dropout(*args, measure_fn=measure)
    assert (again["applied"], again["source"], len(calls)) == (want, "cached", 1)
    assert type(model[1]) is nn.Dropout, "deciding leaves the model as it is"
    off = decide_fast_dropout(model, "false", "fp32", None, lambda: batch, CPU, contextlib.nullcontext)
    assert off["applied"] is False and off["source"] == "requested"


def test_measure_times_both_masks_and_restores_the_model(tiny_cfg) -> None:
    from train.data import prepare_data
    from train.models.dropout import measure
    from train.precision import PrecisionPolicy
    from train.setup import build_run, probe_steps

    cfg = tiny_cfg("model.dropout=0.1")
    run = build_run(cfg, prepare_data(cfg, None, notice=lambda *a, **k: None), CPU,
                    PrecisionPolicy.for_config(cfg, CPU))
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    rng = torch.get_rng_state()
    with probe_steps(cfg, run.model, run.policy, CPU) as step:
        m = measure(run.model, step, next(iter(run.loaders["train"])), CPU, rounds=3)
    assert m["torch_ms"] > 0 and m["fast_ms"] > 0 and m["low"] <= m["speedup"] <= m["high"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    assert not any(isinstance(x, FastDropout) for x in run.model.modules())


def test_fast_dropout_trains_resumes_bit_identically_and_is_reported(wndb, tmp_path) -> None:
    over = tiny_overrides(wndb, tmp_path, "train.max_steps=12", "train.log_every=1", "model.fast_dropout=true")
    ref = run_training(load_config(None, over + ["train.run_id=fref"]), time.perf_counter())
    lever = ref["levers"]["fast_dropout"]
    assert lever["applied"] and lever["modules"] > 0 and lever["not_swapped"]
    cfg = load_config(None, over + ["train.run_id=fmid", "train.checkpoint_every=5"])
    run_training(cfg, time.perf_counter())
    run_dir = tmp_path / "runs" / "fmid"
    (run_dir / "checkpoint.pt").unlink()
    (run_dir / "report.json").unlink()
    run_training(cfg, time.perf_counter(), resume=str(list_checkpoints(run_dir)[0]))
    assert_same_final_state(tmp_path / "runs" / "fref", run_dir)
    plain = run_training(load_config(None, over[:-1] + ["train.run_id=fplain", "model.fast_dropout=false"]),
                         time.perf_counter())
    assert plain["quality"]["final_train_loss"] != ref["quality"]["final_train_loss"], "another random stream"


def test_auto_is_resolved_into_the_runs_config(wndb, tmp_path, monkeypatch) -> None:
    from train.models import dropout

    measure, _ = _forced(1.3, 1.2, 1.4)
    monkeypatch.setattr(dropout, "measure", measure)
    over = tiny_overrides(wndb, tmp_path, "train.max_steps=3")
    report = run_training(load_config(None, [o for o in over if "fast_dropout" not in o] + ["train.run_id=fauto"]),
                          time.perf_counter())
    assert report["levers"]["fast_dropout"]["applied"] and report["levers"]["fast_dropout"]["source"] == "measured"
    saved = (Path(report["run_dir"]) / "config.yaml").read_text()
    assert "fast_dropout: 'true'" in saved or "fast_dropout: \"true\"" in saved or "fast_dropout: true" in saved
    assert json.dumps(report["levers"]["fast_dropout"])

"""One step, one measurement: a benchmark row trains exactly the step `make train` runs, and one `make bench` run
makes each `auto` decision once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from train.bench.rows import CONFIGS
from train.bench.training import arm_config, build_arm, run_training_bench
from train.callbacks import Callback
from train.data import prepare_data
from train.precision import PrecisionPolicy
from train.run.training import run_training

CPU = torch.device("cpu")


class _FirstStep(Callback):
    """Keeps the loss and every gradient of training step 1 (before step 2 clears them)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.grads, self.loss = trainer, None, None

    def on_step_end(self, step, step_ms):
        if step == 1:
            self.grads = {n: p.grad.clone() for n, p in self.trainer.model.named_parameters() if p.grad is not None}
        return False

    def on_log(self, record):
        if record["step"] == 1:
            self.loss = record["loss"]


class _Capture:
    """A run_training hook: attaches :class:`_FirstStep` to the run's trainer."""

    def attach(self, trainer, run_dir):
        self.cb = _FirstStep(trainer)
        trainer.add_callback(self.cb)

    def finish(self, report):
        pass


@pytest.mark.parametrize("row", ["optimized", "optimized-packed"])
def test_a_bench_arm_takes_the_step_make_train_takes(tiny_cfg, row) -> None:
    """One batch through `make train`'s path and through a `make bench` arm: the same loss and gradients, bit-exact."""
    base = tiny_cfg("train.log_every=1", "train.eval_every=100", "model.dropout=0.1", "batching.max_tokens=256")
    cfg = arm_config(base, list(CONFIGS[row].overrides) + ["train.precision=fp32", "train.max_steps=2"])
    hook = _Capture()
    run_training(cfg.with_values({"train.run_id": f"one-step-{row}"}), time.perf_counter(), hooks=(hook,))

    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    arm = build_arm(row, cfg, bundle, CPU, PrecisionPolicy.for_config(cfg, CPU), lambda _m: None)
    rec = arm.run.trainer.step()
    assert rec.step == 1 and hook.cb.grads
    assert float(rec.loss) == hook.cb.loss, "the same loss"
    grads = {n: p.grad for n, p in arm.run.model.named_parameters() if p.grad is not None}
    assert grads.keys() == hook.cb.grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, hook.cb.grads[name]), f"{name}: the gradient differs"


def test_every_auto_row_runs_one_precision_even_when_the_probe_changes_its_mind(tiny_cfg, monkeypatch) -> None:
    """The auto precision probe answers bf16, fp32, bf16, … on successive calls: one `make bench` run still decides
    once, every auto row trains in that precision, and bench.json records the decision once."""
    real = PrecisionPolicy.for_config
    answers = iter(["bf16", "fp32"] * 20)
    calls = []

    def flaky(cfg, device):
        if cfg.train.precision != "auto":
            return real(cfg, device)
        mode = next(answers)
        calls.append(mode)
        return PrecisionPolicy(mode=mode, reason=f"flaky probe said {mode}", device=device, source="measured")

    monkeypatch.setattr(PrecisionPolicy, "for_config", staticmethod(flaky))
    cfg = tiny_cfg("train.run_id=flaky", "bench.warmup_steps=1", "bench.rounds=1", "bench.window=1",
                   "bench.skip_inference=true", "bench.configs=naive,naive+precision-auto,hf-style,optimized")
    from train.bench.suite import run_bench_suite

    out = run_bench_suite(cfg)
    rows = {r["name"]: r for r in out["training"]["configs"]}
    auto_rows = ["naive+precision-auto", "hf-style", "optimized"]
    assert len(calls) == 1, f"auto decided {len(calls)} times"
    assert {rows[n]["precision"] for n in auto_rows} == {calls[0]} and rows["naive"]["precision"] == "fp32"
    on_disk = json.loads((Path(out["run_dir"]) / "bench" / "bench.json").read_text())
    assert on_disk["training"]["precision_auto"]["precision"] == calls[0]

    # the gate's path (rows handed a policy) and a second call on its own: again one decision per call
    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    again = run_training_bench(cfg, bundle, CPU, auto_rows, notice=lambda _m: None)
    assert len(calls) == 2 and {r["precision"] for r in again} == {calls[1]}


def test_a_resolved_config_is_a_value(tiny_cfg) -> None:
    from dataclasses import FrozenInstanceError

    cfg = tiny_cfg("train.run_id=frozen")
    report = run_training(cfg, time.perf_counter())
    assert cfg.train.max_steps == 30 and not cfg.frozen, "the caller's config is left as it was"
    frozen = tiny_cfg().freeze()
    with pytest.raises(FrozenInstanceError, match="with_values"):
        frozen.train.max_steps = 3
    new = frozen.with_values({"train.max_steps": 3})
    assert new.train.max_steps == 3 and new.frozen and frozen.train.max_steps == 30
    saved = (Path(report["run_dir"]) / "config.yaml").read_text()
    assert "run_id: frozen" in saved

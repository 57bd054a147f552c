"""The resolve phase (train/resolve.py): every ``auto`` decided once, a frozen config out, the loaded one untouched;
and a run whose config only ever travels down the layers."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import yaml

from train.config import RunConfig, load_config
from train.data import batching_auto, prepare_data
from train.models import dropout
from train.parallel.process_group import DistContext
from train.resolve import decision_lines, resolve_run
from train.run.training import run_training
from train.setup import apply_threads_and_seed

CPU = torch.device("cpu")


def _forced_packed(*_args, **_kwargs) -> dict:
    return {"ratio": 1.5, "repeats": 2, "packed": {"samples_per_s": 150.0, "token_efficiency": 0.99},
            "buckets": {"samples_per_s": 100.0, "token_efficiency": 0.88, "bounds": [8, 16, 32]}}


def test_resolve_decides_every_auto_into_a_frozen_config(tiny_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batching_auto, "measure_layouts", _forced_packed)
    cfg = tiny_cfg("batching.method=auto", "model.fast_dropout=auto", "model.dropout=0.1", "train.run_id=")
    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    said: list[str] = []
    resolved = resolve_run(cfg, "drawn-id", bundle, CPU, DistContext(), say=lambda line, **_: said.append(line))
    out = resolved.cfg
    assert out.frozen and not cfg.frozen
    assert (out.train.run_id, out.batching.method) == ("drawn-id", "packed")
    assert out.model.fast_dropout in ("true", "false")
    assert (cfg.train.run_id, cfg.batching.method, cfg.model.fast_dropout) == (None, "auto", "auto")  # untouched
    assert resolved.batching_auto["chosen"] == "packed" and said and said[0].startswith("batching:")
    assert resolved.attention is not None and resolved.packed_attention["path"] == resolved.attention.path
    assert max(resolved.bundle.bounds) > max(bundle.bounds) or resolved.bundle.plan_source != bundle.plan_source
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.batching.method = "optimal"
    lines = decision_lines(resolved, "cpu")
    names = [line.split()[0] for line in lines[1:]]
    assert names[:9] == ["device", "precision", "compile", "buckets", "data", "dropout", "attention", "memory",
                         "optimizer"]
    assert names[9:] in ([], ["probes"])  # the probes line where an auto probe measured or was skipped


def test_resolve_keeps_explicit_settings_and_measures_nothing(tiny_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("an explicit setting was measured")

    monkeypatch.setattr(batching_auto, "measure_layouts", refuse)
    monkeypatch.setattr(dropout, "measure", refuse, raising=False)
    cfg = tiny_cfg("batching.method=optimal", "model.fast_dropout=false", "train.precision=fp32",
                   "compile.enabled=false")
    bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
    resolved = resolve_run(cfg, "t", bundle, CPU, DistContext())
    assert resolved.cfg.to_dict() == cfg.with_values({}).to_dict()
    assert resolved.batching_auto is None and resolved.attention is None
    assert resolved.bundle is bundle


def _no_probe(*_a, **_k):
    raise AssertionError("a decision recorded in config.yaml was measured again")


def test_config_yaml_records_every_auto_decision_and_a_rerun_measures_none(
        tiny_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine caches no measured decision (another run could choose otherwise): config.yaml holds each one,
    so ``--config runs/<id>/config.yaml`` makes the same choices without probing. The inputs are forced."""
    for module in ("train.precision", "train.models.dropout", "train.data.batching_auto"):
        monkeypatch.setattr(f"{module}.machine_load", lambda: 1e6)  # busy: used for the run, never cached
    monkeypatch.setattr("train.precision.cpu_native_bf16", lambda: True)
    monkeypatch.setattr("train.precision.measure_bf16_speedup",
                        lambda probe, repeats=9: {"fp32_ms": 3.0, "bf16_ms": 1.0, "ratio": 3.0, "repeats": repeats})
    monkeypatch.setattr(batching_auto, "measure_layouts", _forced_packed)
    monkeypatch.setattr(dropout, "measure", lambda *_a, **_k: {"speedup": 1.5, "low": 1.2, "high": 1.8, "rounds": 5,
                                                               "fast_ms": 2.0, "torch_ms": 3.0})
    cfg = tiny_cfg("train.max_steps=2", "train.eval_every=2", "model.dropout=0.1", "batching.method=auto",
                   "model.fast_dropout=auto", "train.precision=auto", "compile.enabled=auto")
    first = run_training(cfg, 0.0)
    run_dir = Path(first["run_dir"])
    saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    decided = {"train.precision": "bf16", "compile.enabled": "auto", "batching.method": "packed",
               "model.fast_dropout": "true"}  # compile's auto is a rule (no measurement): it stays auto
    assert {k: saved[k.split(".")[0]][k.split(".")[1]] for k in decided} == decided
    assert saved["model"]["packed_attention"] != "auto"
    for module, name in (("train.precision", "measure_bf16_speedup"), ("train.data.batching_auto", "measure_layouts"),
                         ("train.models.dropout", "measure"), ("train.data.attention", "machine_load")):
        monkeypatch.setattr(f"{module}.{name}", _no_probe)
    again = run_training(load_config(str(run_dir / "config.yaml"), ["train.run_id=rerun"]), 0.0)
    assert again["env"]["precision"] == first["env"]["precision"] == "bf16"
    assert again["levers"]["fast_dropout"]["applied"] and again["batching"]["method"] == "packed"
    assert again["batching"]["attention_path"] == first["batching"]["attention_path"]
    rerun = yaml.safe_load((Path(again["run_dir"]) / "config.yaml").read_text(encoding="utf-8"))
    assert {**rerun, "train": {**rerun["train"], "run_id": "t"}} == saved


LAYERS = (("train.commands", "train.cli", "train.__main__"),
          ("train.run", "train.bench", "train.optimize"),
          ("train.setup", "train.resolve", "train.report", "train.resume"),
          ("train.trainer",))


def layer(module: str) -> int:
    """5 commands, 4 drivers, 3 run set-up, 2 the step, 1 components and core (the layers of
    docs/architecture.md)."""
    for rank, prefixes in zip((5, 4, 3, 2), LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return 1


def test_a_run_passes_its_config_only_down_the_layers(tiny_cfg, tmp_path: Path) -> None:
    """Followed at run time: every call of the package that receives a ``RunConfig`` (as an argument, or as ``self``'s
    ``cfg``) is made from a module of the same or a higher layer. A component handing the config back up to the
    set-up or a command (a callback that takes it, a hub that re-reads it) fails here."""
    climbs: set[str] = set()
    calls = 0

    def tracer(frame, event, _arg):
        nonlocal calls
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if not (callee.startswith("train") and caller.startswith("train")):
            return
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if any(isinstance(a, RunConfig) for a in args):
            calls += 1
            if layer(callee) > layer(caller):
                climbs.add(f"{caller} -> {callee}.{code.co_name}")

    cfg = tiny_cfg("train.max_steps=4", "train.eval_every=4", "batching.method=auto")
    sys.setprofile(tracer)
    try:
        report = run_training(cfg, 0.0)
    finally:
        sys.setprofile(None)
    assert report["status"] == "completed"
    assert calls > 20  # the trace really saw the config travel
    assert not climbs, f"the config climbed back up a layer: {sorted(climbs)}"
    component = {"__name__": "train.data.fake", "seed": apply_threads_and_seed}  # the trace sees a climb
    exec("def hand_back(cfg):\n    seed(cfg)\n", component)
    sys.setprofile(tracer)
    try:
        component["hand_back"](cfg)
    finally:
        sys.setprofile(None)
    assert climbs == {"train.data.fake -> train.setup.apply_threads_and_seed"}
    assert layer("train.data.batching_auto") < layer("train.trainer") < layer("train.resolve") < layer(
        "train.run.training")

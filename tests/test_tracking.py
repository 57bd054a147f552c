"""Tracking: W&B fallbacks (import failure, hanging init, failing log) with fakes, sampling cadence of
metrics.jsonl, per-layer gradient statistics, system metrics (fake NVML)."""

from __future__ import annotations

import json
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import ListLogger
from train.config import TrackingConfig
from train.run.training import run_training
from train.tracking.gradstats import GradStats, grad_table
from train.tracking.loggers import JsonlLogger
from train.tracking.system import SystemMonitor
from train.tracking.wandb_logger import WandbLogger, resolve_mode, to_wandb

# -- mode resolution -----------------------------------------------------------------------------

def test_resolve_mode(tmp_path: Path) -> None:
    no_netrc = {"NETRC": str(tmp_path / "none")}
    assert resolve_mode(TrackingConfig(), no_netrc) == ("offline", None)
    assert resolve_mode(TrackingConfig(wandb="off"), no_netrc)[0] is None
    assert resolve_mode(TrackingConfig(), {**no_netrc, "WANDB_MODE": "disabled"})[0] is None
    mode, note = resolve_mode(TrackingConfig(mode="online"), no_netrc)
    assert mode == "offline" and "no API key" in note
    assert resolve_mode(TrackingConfig(), {**no_netrc, "WANDB_MODE": "online", "WANDB_API_KEY": "k"}) == \
        ("online", None)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai login user password secret\n")
    netrc.chmod(0o600)
    assert resolve_mode(TrackingConfig(mode="online"), {"NETRC": str(netrc)}) == ("online", None)


def test_to_wandb_flattens_records() -> None:
    assert to_wandb({"step": 5, "loss": 1.5, "lr": 0.1, "steps_in_window": 5}) == \
        {"train/loss": 1.5, "train/lr": 0.1, "train/steps_in_window": 5, "step": 5}
    assert to_wandb({"step": 5, "event": "eval", "eval_accuracy": 0.5, "eval_loss": None}) == \
        {"eval/accuracy": 0.5, "step": 5}
    sys_rec = to_wandb({"event": "system", "cpu_percent": 50.0, "gpu_metrics_unavailable_reason": "not a CUDA run"})
    assert sys_rec == {"system/cpu_percent": 50.0}
    g = to_wandb({"step": 10, "event": "grad_stats", "layers": {"head.weight": {"norm": 2.0, "std": 0.1, "numel": 4}}})
    assert g == {"grad_norm/head.weight": 2.0, "grad_std/head.weight": 0.1, "step": 10}


# -- W&B failures, with fakes ----------------------------------------------------------------------

class FakeRun:
    def __init__(self, fail_log: bool = False) -> None:
        self.logged: list[dict] = []
        self.finished = threading.Event()
        self.fail_log = fail_log
        self.dir = "/nonexistent/wandb/offline-run-x/files"

    def log(self, data: dict) -> None:
        if self.fail_log:
            raise ConnectionError("network went away")
        self.logged.append(data)

    def define_metric(self, *a, **k) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        self.finished.set()


def fake_wandb(run: FakeRun, gate: threading.Event | None = None) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    class Settings:
        def __init__(self, **kwargs) -> None:
            if "silent" in kwargs:
                raise TypeError("an older wandb without 'silent'")  # exercised: dropped, others kept
            self.kwargs = kwargs

    def init(**kwargs):
        mod.init_kwargs = kwargs
        if gate is not None:
            gate.wait()  # a hung init
        return run

    mod.Settings, mod.init = Settings, init
    return mod


def test_import_failure_falls_back_with_one_warning(tmp_path: Path) -> None:
    def no_wandb(name: str):
        raise ImportError("No module named 'wandb'")

    with pytest.warns(UserWarning, match="not importable") as caught:
        lg = WandbLogger(TrackingConfig(wandb="on"), "offline", tmp_path, "r", {}, import_module=no_wandb)
        assert lg.wait_ready() is False
        for i in range(5):
            lg.log({"step": i, "loss": 1.0})
        lg.close()
    assert len([w for w in caught if "W&B" in str(w.message)]) == 1
    st = lg.status()
    assert st["wandb_active"] is False and "not importable" in st["wandb_fallback_reason"]


def test_auto_mode_without_wandb_is_silent(tmp_path: Path) -> None:
    def no_wandb(name: str):
        raise ImportError("nope")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lg = WandbLogger(TrackingConfig(wandb="auto"), "offline", tmp_path, "r", {}, import_module=no_wandb)
        lg.close()
    assert lg.status()["wandb_active"] is False


def test_hanging_init_times_out_and_never_blocks_logging(tmp_path: Path) -> None:
    gate, run = threading.Event(), FakeRun()
    mod = fake_wandb(run, gate)
    cfg = TrackingConfig(wandb="on", init_timeout_s=0.5, finish_timeout_s=0.5, queue_size=3)
    with pytest.warns(UserWarning, match="did not finish within"):
        lg = WandbLogger(cfg, "offline", tmp_path, "r", {"a": 1}, import_module=lambda name: mod)
        t0 = time.perf_counter()
        for i in range(20):  # init is hung: the queue fills, the rest is dropped, nothing blocks
            lg.log({"step": i, "loss": 1.0})
        assert time.perf_counter() - t0 < 0.2
        assert lg.dropped == 17
        assert lg.wait_ready() is False
        t1 = time.perf_counter()
        lg.close()
        assert time.perf_counter() - t1 < 0.2  # abandoned: close does not wait again
    assert time.perf_counter() - t0 < 2.0
    st = lg.status()
    assert st["wandb_active"] is False and "init_timeout_s=0.5" in st["wandb_fallback_reason"]
    assert st["dropped_records"] == 17
    assert mod.init_kwargs["settings"].kwargs == {"init_timeout": 0.5, "console": "off"}
    gate.set()  # the init finally returns: the abandoned run is finished, not used
    assert run.finished.wait(5) and run.logged == []


def test_log_failure_warns_once_and_continues(tmp_path: Path) -> None:
    run = FakeRun(fail_log=True)
    mod = fake_wandb(run)
    with pytest.warns(UserWarning, match="run.log failed") as caught:
        lg = WandbLogger(TrackingConfig(wandb="on"), "offline", tmp_path, "r", {}, import_module=lambda name: mod)
        assert lg.wait_ready() is True
        for i in range(10):
            lg.log({"step": i, "loss": 1.0})
        lg.close()
    assert len([w for w in caught if "W&B" in str(w.message)]) == 1
    assert "ConnectionError" in lg.status()["wandb_fallback_reason"] and run.finished.is_set()


def test_records_reach_the_run_in_order(tmp_path: Path) -> None:
    run = FakeRun()
    mod = fake_wandb(run)
    lg = WandbLogger(TrackingConfig(wandb="on"), "offline", tmp_path, "r", {}, import_module=lambda name: mod)
    for i in range(1, 4):
        lg.log({"step": 10 * i, "loss": 1.0 / i})
    lg.log({"event": "system", "cpu_percent": 3.0})
    lg.close()
    assert [d["step"] for d in run.logged] == [10, 20, 30, 30]  # system records carry the last training step
    assert run.logged[-1]["system/cpu_percent"] == 3.0
    assert lg.status()["wandb_active"] is True and lg.status()["wandb_logged_records"] == 4


def test_a_full_disk_under_wandb_logging_prints_no_logging_error_blocks(tmp_path: Path, monkeypatch, capsys) -> None:
    """W&B logs to files under the run directory through `logging`; on a full disk each failed record used to print a
    "--- Logging error ---" block (three of them, 158 stderr lines with the checkpoint error, issue 21)."""
    import logging

    monkeypatch.setattr(logging, "raiseExceptions", True)  # Python's default; restored after the test
    run = FakeRun()
    lg = WandbLogger(TrackingConfig(wandb="on"), "offline", tmp_path, "r", {},
                     import_module=lambda name: fake_wandb(run))
    lg.log({"step": 1, "loss": 1.0})
    lg.close()

    class FullDisk(logging.Handler):
        def emit(self, record):
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                self.handleError(record)

    log = logging.getLogger("wandb-like")
    log.addHandler(FullDisk())
    log.propagate = False
    log.error("a record W&B writes to debug.log")
    assert "Logging error" not in capsys.readouterr().err


# -- gradient statistics -------------------------------------------------------------------------------

def test_grad_stats_report_pre_clip_norms() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model(torch.randn(32, 8)).pow(2).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # clips hard, in place
    assert total > 1.0
    sink = ListLogger()
    gs = GradStats(every=2, clip_norm=0.01)
    gs.after_log(5, model, total, sink)
    assert sink.records == []  # every 2nd logged record only
    gs.after_log(10, model, total, sink)
    rec = sink.records[0]
    assert rec["event"] == "grad_stats" and rec["step"] == 10 and rec["pre_clip"] is True
    assert set(rec["layers"]) == set(before)
    for name, g in before.items():
        assert rec["layers"][name]["norm"] == pytest.approx(float(g.norm()), rel=1e-4)
        assert rec["layers"][name]["std"] == pytest.approx(float(g.std(correction=0)), rel=1e-4)
    # without the clip factor the table shows the clipped gradients
    assert grad_table(list(model.named_parameters()))["2.weight"]["norm"] < 0.011


# -- system metrics --------------------------------------------------------------------------------------

def _fake_pynvml(init_error: Exception | None = None) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0

    def init():
        if init_error:
            raise init_error

    nv.nvmlInit, nv.nvmlShutdown = init, lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    nv.nvmlDeviceGetHandleByUUID = lambda u: "hu"
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30)

    def power(h):
        raise RuntimeError("NVMLError_NotSupported")

    nv.nvmlDeviceGetPowerUsage = power
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61
    return nv


def test_system_metrics_with_and_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_pynvml())
    rec = SystemMonitor(ListLogger(), 1.0, cuda_index=0).sample()
    assert rec["event"] == "system" and rec["process_rss_bytes"] > 0 and 0 <= rec["cpu_percent"] <= 100
    assert rec["gpu_utilization_percent"] == 87 and rec["gpu_memory_used_bytes"] == 3 * 2**30
    assert "gpu_power_w" not in rec and "gpu_power_w: NVMLError_NotSupported" in rec["gpu_metrics_unavailable_reason"]

    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_pynvml(OSError("libnvidia-ml.so.1 not found")))
    rec = SystemMonitor(ListLogger(), 1.0, cuda_index=0).sample()
    assert not any(k.startswith("gpu_") and k != "gpu_metrics_unavailable_reason" for k in rec)
    assert "nvmlInit failed" in rec["gpu_metrics_unavailable_reason"]
    assert SystemMonitor(ListLogger(), 1.0, None).sample()["gpu_metrics_unavailable_reason"] == "not a CUDA run"


def test_system_thread_logs_into_jsonl(tmp_path: Path) -> None:
    jl = JsonlLogger(tmp_path / "m.jsonl")
    mon = SystemMonitor(jl, 0.05)
    mon.start()
    time.sleep(0.4)
    mon.stop()
    jl.close()
    recs = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(recs) == mon.samples >= 2 and all(r["event"] == "system" for r in recs)


# -- end to end: JSONL cadence, report section, import failure ---------------------------------------------

def test_run_jsonl_cadence_and_report(tiny_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = tiny_cfg("train.max_steps=20", "train.log_every=5", "tracking.wandb=on", "tracking.grad_stats_every=2",
                   "tracking.system_interval_s=0.05")
    monkeypatch.delenv("WANDB_MODE")
    with pytest.warns(UserWarning, match="not importable"):
        report = run_training(cfg, time.perf_counter())
    recs = [json.loads(x) for x in (Path(report["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "event" not in r]
    grads = [r for r in recs if r.get("event") == "grad_stats"]
    system = [r for r in recs if r.get("event") == "system"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert [r["step"] for r in grads] == [10, 20]
    assert "head.weight" in grads[0]["layers"] and grads[0]["layers"]["head.weight"]["norm"] > 0
    assert system and all(r["process_rss_bytes"] > 0 for r in system)
    t = report["tracking"]
    assert t["wandb_active"] is False and "not importable" in t["wandb_fallback_reason"]
    assert t["grad_stats_records"] == 2 and t["system_samples"] == len(system)
    assert t["gpu_metrics_unavailable_reason"] == "not a CUDA run"
    assert report["quality"]["final_train_loss"] is not None  # training finished


def test_run_shorter_than_the_interval_still_has_system_records(tiny_cfg) -> None:
    """One sample when the monitor starts and one when it stops: no race with the clock, on any machine."""
    report = run_training(tiny_cfg("train.max_steps=2", "tracking.system_interval_s=3600"), time.perf_counter())
    recs = [json.loads(x) for x in (Path(report["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    system = [r for r in recs if r.get("event") == "system"]
    assert len(system) == 2 == report["tracking"]["system_samples"]
    assert all(r["process_rss_bytes"] > 0 for r in system)

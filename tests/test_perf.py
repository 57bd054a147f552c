"""Measurement primitives: percentiles, FLOPs, MFU, energy sources (mocked NVML / fake RAPL), memory phases."""

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from train.models.encoder import EncoderClassifier, resolve_spec
from train.models.flops import StepFlops, training_step_flops
from train.perf.devices import mfu_fields, table_peak
from train.perf.energy import EnergyMeter, integrate_power, per_unit
from train.perf.memory import WindowPeakMemory
from train.perf.timer import StepTimer, percentiles


def test_percentiles_match_numpy() -> None:
    values = np.random.default_rng(0).lognormal(3, 1, 997)
    got = percentiles(values)
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_step_timer_separates_the_first_step() -> None:
    timer = StepTimer(torch.device("cpu"))
    for _ in range(3):
        timer.start()
        timer.stop()
    assert timer.first_ms is not None and len(timer.steady_ms) == 2


def test_step_flops_extrapolation_equals_direct_counting() -> None:
    spec = resolve_spec("tiny", 300, 9, 64, dropout=0.0, num_layers=2, hidden_size=32, num_heads=4, ffn_size=48)
    model = EncoderClassifier(spec)
    flops = StepFlops(spec)
    for b, s in [(1, 5), (7, 33), (3, 64)]:
        ids = torch.randint(4, 300, (b, s))
        assert flops(b, s) == training_step_flops(model, ids, torch.ones(b, s, dtype=torch.bool))


def test_one_encoder_layer_against_the_hand_formula() -> None:
    b, s, h, f, c = 2, 10, 64, 256, 5
    spec = resolve_spec("tiny", 100, c, 16, num_layers=1, hidden_size=h, num_heads=4, ffn_size=f)
    linears = 2 * b * s * (3 * h * h + h * h + 2 * h * f) + 2 * b * h * c  # 2·m·n·k per Linear, forward
    attention = 4 * b * s * s * h  # QKᵀ and A·V, forward
    assert StepFlops(spec)(b, s) == 3 * linears + 3 * attention  # backward = 2 × forward


def test_mfu_arithmetic_and_table_lookup() -> None:
    peak, why = table_peak("NVIDIA H200", "bf16")
    assert peak == pytest.approx(989.4e12) and why is None
    assert table_peak("cpu", "fp32")[0] is None
    assert table_peak(" nvidia  H200", "bf16")[0] == pytest.approx(989.4e12)  # case and spacing aside
    assert table_peak("NVIDIA H200 NVL", "bf16")[0] == pytest.approx(835.5e12)  # its own row, not the SXM part's
    assert table_peak("NVIDIA H200 Something", "bf16")[0] is None  # never a prefix match
    out = mfu_fields(1e12, torch.device("cpu"), "NVIDIA H200", "bf16", measure=False)
    assert out["mfu"] == pytest.approx(1e12 / 989.4e12) and out["mfu_peak_source"] == "device table"
    cpu = mfu_fields(None, torch.device("cpu"), "cpu", "fp32", measure=False)
    assert cpu["mfu"] is None and "mfu_unavailable_reason" in cpu


class FakeNvml(types.ModuleType):
    """pynvml stand-in: energy counter in mJ, power in mW; either can raise NotSupported."""

    class NVMLError_NotSupported(Exception):
        pass

    def __init__(self, counter: bool, power: bool) -> None:
        super().__init__("pynvml")
        self.counter, self.power, self.mj = counter, power, 1_000_000

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        if not self.counter:
            raise self.NVMLError_NotSupported()
        self.mj += 2500  # each reading: 2.5 J later
        return self.mj

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if not self.power:
            raise self.NVMLError_NotSupported()
        return 200_000  # 200 W


@pytest.fixture
def cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return torch.device("cuda", 0)


def test_energy_counter(monkeypatch, cuda_device) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(counter=True, power=True))
    meter = EnergyMeter(cuda_device)
    assert meter.source == "nvml-energy-counter"
    meter.start()
    assert meter.stop() == {"energy_j": 2.5, "energy_source": "nvml-energy-counter"}


def test_energy_power_integration_when_counter_unsupported(monkeypatch, cuda_device) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(counter=False, power=True))
    meter = EnergyMeter(cuda_device, sample_interval_s=0.005)
    assert meter.source == "nvml-power-sampling"
    meter.start()
    import time

    time.sleep(0.2)
    out = meter.stop()
    assert out["energy_source"] == "nvml-power-sampling"
    assert 0.5 * 200 * 0.2 < out["energy_j"] < 1.5 * 200 * 0.2  # ≈ 200 W × 0.2 s
    assert integrate_power([(0.0, 100.0), (1.0, 300.0)]) == 200.0


def test_energy_null_with_reason_never_zero(monkeypatch, cuda_device, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(counter=False, power=False))
    out = EnergyMeter(cuda_device).stop()
    assert out["energy_j"] is None and "unsupported" in out["energy_unavailable_reason"]
    cpu = EnergyMeter(torch.device("cpu"), rapl_root=str(tmp_path))
    cpu.start()
    out = cpu.stop()
    assert out["energy_j"] is None and "RAPL" in out["energy_unavailable_reason"]
    unit = per_unit(out, 10, 100, 1000)
    assert unit["energy_j_per_sample"] is None and unit["energy_unavailable_reason"]


def test_rapl_reader_with_wraparound(tmp_path: Path) -> None:
    dom = tmp_path / "intel-rapl:0"
    dom.mkdir()
    (dom / "max_energy_range_uj").write_text("1000000\n")
    (dom / "energy_uj").write_text("999000\n")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-domain: not summed
    meter = EnergyMeter(torch.device("cpu"), rapl_root=str(tmp_path))
    assert meter.source == "rapl"
    meter.start()
    (dom / "energy_uj").write_text("4000\n")  # wrapped: 1,000 + 4,000 µJ
    assert meter.stop()["energy_j"] == pytest.approx(0.005)


def test_window_peak_memory_resets_between_phases() -> None:
    mem = WindowPeakMemory(torch.device("cpu"))
    if not mem.resettable_rss:
        pytest.skip("/proc/self/clear_refs not writable here")
    mem.start()
    big = np.ones(400 * 2**20 // 8)  # 400 MiB touched
    first = mem.stop()["peak_memory_bytes"]
    del big
    mem.start()
    second = mem.stop()["peak_memory_bytes"]
    assert first - second > 300 * 2**20


def test_module_flops_equals_the_encoders_own_count_and_a_hand_count_for_hf_bert() -> None:
    """FLOPs for any module (train/perf/flops.py ModuleFlops): the built-in encoder's analytic count, and a hand
    count of a small Hugging Face BERT (2 FLOPs per multiply-add, backward = 2 x forward)."""
    from train.models.encoder import EncoderClassifier, resolve_spec
    from train.models.flops import StepFlops
    from train.perf.flops import ModuleFlops

    spec = resolve_spec("tiny", 60, 5, 32, 0.1, num_layers=2, hidden_size=32, num_heads=2, ffn_size=64)
    enc = EncoderClassifier(spec)
    counted, analytic = ModuleFlops(enc, spec.max_len), StepFlops(spec)
    for b, s in ((1, 4), (3, 12), (7, 32)):
        assert counted(b, s) == analytic(b, s), (b, s)
    assert counted.attention_seen and all(p.grad is None for p in enc.parameters()), "no trace left"

    transformers = pytest.importorskip("transformers")
    from train.models.wrap import ExternalClassifier, ExternalSpec

    h, f, layers, c = 32, 64, 2, 5
    from train.compat import hf_attn_implementation  # eager on torch 2.1.0: transformers refuses SDPA there

    hf = transformers.AutoModelForSequenceClassification.from_config(transformers.BertConfig(
        vocab_size=100, hidden_size=h, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=f,
        max_position_embeddings=64, num_labels=c), attn_implementation=hf_attn_implementation())
    model = ExternalClassifier(hf, ExternalSpec("hf:bert", c, 100, 64, h, layers), "hf")

    def hand(b: int, s: int) -> int:  # QKV + output projection + FFN per token, QKᵀ and A·V, pooler + classifier
        per_token = layers * (2 * h * 3 * h + 2 * h * h + 2 * 2 * h * f)
        return 3 * b * (s * per_token + layers * 4 * s * s * h + 2 * h * h + 2 * h * c)

    flops = ModuleFlops(model, 64)
    for b, s in ((1, 4), (2, 10), (16, 48)):
        assert flops(b, s) == hand(b, s), (b, s)


def test_saved_tensor_meter_counts_each_saved_activation_once_and_no_weight() -> None:
    """Linear → ReLU → Linear on [5, 8]: the first Linear saves its input x (160 B), ReLU its output (640 B), which
    the second Linear saves again (the same storage, counted once); the weights are left out. With the first layer
    frozen and x not requiring grad, nothing before the ReLU's output is saved."""
    from train.perf.memory import SavedTensorMeter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(5, 8)
    with SavedTensorMeter(model.parameters()) as meter:
        model(x).sum().backward()
    assert meter.bytes == 5 * 8 * 4 + 5 * 32 * 4 and meter.unreadable == 0
    model[0].requires_grad_(False)
    with SavedTensorMeter(model.parameters()) as meter:
        model(x).sum()
    assert meter.bytes == 5 * 32 * 4


def test_the_first_step_counts_its_activations_and_the_report_adds_up_the_tensors() -> None:
    """The trainer's first counted step meters its activations (fewer with checkpointed blocks; a probe step, not
    counted, meters nothing), and report.json's ``model.memory`` adds weights, gradients, optimizer state and them."""
    from tests.conftest import global_batch, tiny_llama, trainer_for
    from train.models.block_checkpoint import set_checkpoint_blocks
    from train.report.levers import memory_split

    def trainer(on: bool):
        model = tiny_llama()
        set_checkpoint_blocks(model, on)
        t = trainer_for(model, True)
        t.step(global_batch(0, True), count=False)
        assert t.activation_bytes is None
        t.step(global_batch(0, True))
        return t

    plain, checkpointed = trainer(False), trainer(True)
    assert plain.activation_bytes > 0 and checkpointed.activation_bytes < plain.activation_bytes / 2
    m = memory_split(plain.model, plain.optimizer, {"peak_memory_source": "process peak RSS (getrusage)"},
                     plain.activation_bytes)
    assert m["activations_bytes"] == plain.activation_bytes and m["optimizer_state_bytes"] > 0
    assert m["tensor_bytes"] == (m["frozen_weights_bytes"] + 2 * m["trainable_weights_bytes"]
                                 + m["optimizer_state_bytes"] + plain.activation_bytes)
    unmeasured = memory_split(plain.model, plain.optimizer, {"peak_memory_source": "process peak RSS (getrusage)"})
    assert unmeasured["activations_bytes"] is None and unmeasured["tensor_bytes"] is None
    assert "not measured" in unmeasured["activations_reason"]


def test_the_profilers_own_stderr_lines_are_left_out_and_every_other_line_kept(capfd) -> None:
    """Descriptor 2 while the profiler starts and stops (its USDT lines come from C++, not Python): those lines are
    dropped, a line of anyone else is written back."""
    import os

    from torch.profiler import ProfilerActivity, profile

    from train.profiling.native_noise import filtered_stderr

    x = torch.randn(64, 64)
    prof = profile(activities=[ProfilerActivity.CPU])
    with filtered_stderr():
        prof.start()
        os.write(2, b"USDT:2026-12-07 22:14:23 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a line of our own\n")
    x @ x
    with filtered_stderr():
        prof.stop()
    err = capfd.readouterr().err
    assert "USDT" not in err and "SyncActivityProfilerHandler" not in err
    assert err.count("a line of our own") == 1


def test_a_forward_that_refuses_saved_tensor_hooks_runs_again_unmetered() -> None:
    """torch.func transforms refuse saved-tensor hooks (older transformers build attention masks with vmap): that
    forward runs again without the meter and no figure is given; any other error is the caller's."""
    from train.perf.memory import metered

    calls = []

    def refuses() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("torch.func transforms don't yet support saved tensor hooks. Please open an issue")
        return 5

    assert metered(refuses, [], True) == (5, None) and len(calls) == 2
    x = torch.randn(3, 4, requires_grad=True)
    out, saved = metered(lambda: (x * x).sum(), [], True)
    assert saved == 3 * 4 * 4 and metered(lambda: 7, [], False) == (7, None)

    def broken() -> None:
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        metered(broken, [], True)

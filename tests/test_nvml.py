"""One NVML opener (train/perf/nvml.py): the torch device → NVML handle by UUID, then CUDA_VISIBLE_DEVICES, then
the index, and energy, the profiler's GPU sampler and system metrics all reading the GPU it finds (fake NVML:
this machine has no GPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.conftest import ListLogger
from train.perf import nvml as nvml_mod
from train.perf.energy import EnergyMeter
from train.perf.nvml import nvml_handle, visible_devices
from train.profiling.gpu_sampler import nvml_reader
from train.tracking.system import SystemMonitor

UUIDS = [f"GPU-{c * 8}-1111-2222-3333-{c * 12}" for c in "abc"]  # NVML devices 0, 1, 2 (PCI-bus order)


class FakeNvml(types.ModuleType):
    """pynvml stand-in with three GPUs whose every reading tells which GPU it came from."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0

    class NVMLError(Exception):
        pass

    def __init__(self, init_error: Exception | None = None) -> None:
        super().__init__("pynvml")
        self.init_error, self.inits, self.shutdowns = init_error, 0, 0
        self.energy_mj = [0, 0, 0]
        self.mig = {"MIG-99999999-0000-0000-0000-000000000000": "mig0"}

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        if not 0 <= i < len(UUIDS):
            raise self.NVMLError("Invalid Argument")
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h: str) -> bytes:
        return UUIDS[int(h[1:])].encode()  # older bindings return bytes

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid in UUIDS:
            return f"h{UUIDS.index(uuid)}"
        if uuid in self.mig:
            return self.mig[uuid]
        raise self.NVMLError("Not Found")

    def _i(self, h: str) -> int:
        return int(h[1:])

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        self.energy_mj[self._i(h)] += 1000 * (self._i(h) + 1)  # GPU k: (k + 1) J per reading
        return self.energy_mj[self._i(h)]

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 100_000 * (self._i(h) + 1)  # GPU k: (k + 1) × 100 W

    def nvmlDeviceGetUtilizationRates(self, h: str):
        return types.SimpleNamespace(gpu=10 + self._i(h), memory=20 + self._i(h))

    def nvmlDeviceGetMemoryInfo(self, h: str):
        return types.SimpleNamespace(used=(self._i(h) + 1) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 1000 + self._i(h)

    def nvmlDeviceGetTemperature(self, h: str, kind: int) -> int:
        return 50 + self._i(h)


class TorchUuid:
    """Like torch's ``_CUuuid``: ``str()`` is the bare UUID, without ``GPU-``."""

    def __init__(self, nvml_uuid: str) -> None:
        self.text = nvml_uuid[4:]

    def __str__(self) -> str:
        return self.text


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nv = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return nv


def torch_sees(monkeypatch: pytest.MonkeyPatch, nvml_indices: list[int] | None) -> None:
    """torch's CUDA device i is NVML device ``nvml_indices[i]`` (by UUID); None: torch reports no UUID."""

    def props(i: int):
        if nvml_indices is None:
            raise RuntimeError("Found no NVIDIA driver on your system")
        return types.SimpleNamespace(name="fake", uuid=TorchUuid(UUIDS[nvml_indices[i]]))

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)


def permuted(monkeypatch: pytest.MonkeyPatch, with_uuid: bool = True) -> None:
    """CUDA_VISIBLE_DEVICES=2,0: CUDA device 0 is NVML device 2, CUDA device 1 is NVML device 0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    torch_sees(monkeypatch, [2, 0] if with_uuid else None)


def test_uuid_mapping_under_permuted_visible_devices(fake, monkeypatch) -> None:
    permuted(monkeypatch)
    handle, how = nvml_handle(torch.device("cuda", 0))
    assert handle == "h2" and "by UUID" in how and "NVML device 2" in how, how
    assert nvml_handle(torch.device("cuda", 1))[0] == "h0"
    assert nvml_handle(torch.device("cuda"))[0] == "h2"  # no index: the current device (0)
    assert nvml_handle(1)[0] == "h0"  # an integer is a CUDA index
    assert fake.inits == 1  # initialised once


def test_uuid_wins_over_a_misleading_visible_devices(fake, monkeypatch) -> None:
    """The UUID is exact even when integer ordinals are not NVML's (CUDA_DEVICE_ORDER=FASTEST_FIRST)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    torch_sees(monkeypatch, [1, 0])
    assert nvml_handle(torch.device("cuda", 0))[0] == "h1"


def test_visible_devices_integers_when_torch_has_no_uuid(fake, monkeypatch) -> None:
    permuted(monkeypatch, with_uuid=False)
    handle, how = nvml_handle(torch.device("cuda", 0))
    assert handle == "h2" and "CUDA_VISIBLE_DEVICES='2,0' entry 0" in how and "no UUID from torch" in how, how
    assert nvml_handle(torch.device("cuda", 1))[0] == "h0"


def test_visible_devices_uuid_strings(fake, monkeypatch) -> None:
    torch_sees(monkeypatch, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUIDS[2]},{UUIDS[0][:10]},MIG-99999999-0000-0000-0000-000000000000")
    handle, how = nvml_handle(torch.device("cuda", 0))
    assert handle == "h2" and UUIDS[2] in how, how
    assert nvml_handle(torch.device("cuda", 1))[0] == "h0"  # a unique prefix, as CUDA accepts
    assert nvml_handle(torch.device("cuda", 2))[0] == "mig0"  # a MIG instance, looked up by its UUID


def test_index_fallback_and_its_reason(fake, monkeypatch) -> None:
    torch_sees(monkeypatch, None)
    handle, how = nvml_handle(torch.device("cuda", 1))
    assert handle == "h1" and "by index" in how and "CUDA_VISIBLE_DEVICES unset" in how, how


def test_visible_devices_parsing() -> None:
    assert visible_devices(None) is None
    assert visible_devices(" 2, 0 ") == ["2", "0"]
    assert visible_devices("1,foo,0") == ["1"]  # CUDA ignores everything from the first invalid entry
    assert visible_devices("GPU-ab12,MIG-cd34") == ["GPU-ab12", "MIG-cd34"]
    assert visible_devices("") == [] and visible_devices("-1") == []


def test_unavailable_is_none_and_a_reason(fake, monkeypatch) -> None:
    assert nvml_handle(torch.device("cpu")) == (None, "not a CUDA device (cpu)")
    torch_sees(monkeypatch, None)
    handle, why = nvml_handle(torch.device("cuda", 7))  # no such GPU by any mapping
    assert handle is None and why.startswith("no NVML handle for CUDA device 7") and "\n" not in why
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    handle, why = nvml_handle(torch.device("cuda", 5))
    assert handle is None and "lists no entry 5" in why
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_error=OSError("libnvidia-ml.so.1 not found")))
    handle, why = nvml_handle(torch.device("cuda", 0))
    assert handle is None and why.startswith("nvmlInit failed (OSError")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    handle, why = nvml_handle(torch.device("cuda", 0))
    assert handle is None and "pip install nvidia-ml-py" in why


def test_energy_reads_the_mapped_gpu(fake, monkeypatch) -> None:
    permuted(monkeypatch)
    meter = EnergyMeter(torch.device("cuda", 0))
    assert meter.source == "nvml-energy-counter" and "NVML device 2" in meter.nvml_mapping
    meter.start()
    assert meter.stop() == {"energy_j": 3.0, "energy_source": "nvml-energy-counter"}  # GPU 2: 3 J per reading
    permuted(monkeypatch, with_uuid=False)
    meter = EnergyMeter(torch.device("cuda", 1))
    meter.start()
    assert meter.stop()["energy_j"] == 1.0  # NVML device 0


def test_gpu_sampler_reads_the_mapped_gpu(fake, monkeypatch) -> None:
    permuted(monkeypatch)
    read, why = nvml_reader(0)
    assert why is None and "NVML device 2" in read.nvml_mapping
    assert read() == {"sm_util_pct": 12, "mem_util_pct": 22, "mem_used_bytes": 3 * 2**30, "power_w": 300.0,
                      "sm_clock_mhz": 1002, "mem_clock_mhz": 1002}
    assert nvml_reader(torch.device("cuda", 1))[0]()["sm_util_pct"] == 10


def test_system_metrics_read_the_mapped_gpu(fake, monkeypatch) -> None:
    permuted(monkeypatch)
    mon = SystemMonitor(ListLogger(), 1.0, cuda_index=0)
    rec = mon.sample()
    assert "NVML device 2" in mon.gpu_mapping and "gpu_metrics_unavailable_reason" not in rec
    assert (rec["gpu_utilization_percent"], rec["gpu_power_w"], rec["gpu_temperature_c"]) == (12, 300.0, 52)
    assert SystemMonitor(ListLogger(), 1.0, cuda_index=1).sample()["gpu_memory_used_bytes"] == 2**30


def test_one_init_and_no_shutdown_under_the_others(fake, monkeypatch) -> None:
    """A monitor stopping must not shut NVML down under the energy meter: NVML is initialised once, kept."""
    permuted(monkeypatch)
    meter = EnergyMeter(torch.device("cuda", 0))
    mon = SystemMonitor(ListLogger(), 1.0, cuda_index=0)
    read, _ = nvml_reader(0)
    meter.start()
    mon.start()
    mon.stop()
    assert meter.stop()["energy_j"] == 3.0 and read()["power_w"] == 300.0
    assert (fake.inits, fake.shutdowns) == (1, 0)


def test_real_pynvml_without_a_gpu_is_null_and_reason(monkeypatch) -> None:
    """On this CPU machine: the installed pynvml finds no driver → None + reason, energy null + reason."""
    pytest.importorskip("pynvml")
    monkeypatch.setattr(nvml_mod, "_initialised", None)
    if nvml_mod.nvml()[0] is not None:
        pytest.skip("NVML works here (a GPU driver is installed)")
    handle, why = nvml_handle(torch.device("cuda", 0))
    assert handle is None and why.startswith("nvmlInit failed")
    out = EnergyMeter(torch.device("cuda", 0)).stop()
    assert out["energy_j"] is None and out["energy_unavailable_reason"].startswith("NVML unavailable: nvmlInit failed")

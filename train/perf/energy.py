"""Energy over a measured window: NVML's energy counter, NVML power sampling, or RAPL — else null + reason.

Sources, in order of preference:

1. CUDA: ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the driver loaded; Volta and
   newer) — the difference between two readings is the window's energy.
2. CUDA, counter unsupported (``NVMLError_NotSupported`` on older GPUs): ``nvmlDeviceGetPowerUsage``
   (milliwatts) sampled by a background thread and integrated with the trapezoidal rule.
3. CPU: Linux RAPL, ``/sys/class/powercap/intel-rapl:*/energy_uj`` (package domains; microjoules,
   wrapping at ``max_energy_range_uj``), when readable.
4. Otherwise ``energy_j = None`` with ``energy_unavailable_reason``. Never 0, never an exception.

NVML comes from ``pynvml`` as shipped by NVIDIA's ``nvidia-ml-py`` package (not the 2017 fork
``nvidia-ml-py3``, which lacks the energy call); the handle from :func:`train.perf.nvml.nvml_handle`, which finds
the GPU by UUID (``CUDA_VISIBLE_DEVICES`` can make CUDA device 0 another NVML index).
"""

from __future__ import annotations

import glob
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from train.perf.nvml import nvml, nvml_handle


class _RaplReader:
    """Sums package-level RAPL domains, handling counter wrap-around."""

    def __init__(self, root: str = "/sys/class/powercap") -> None:
        self.domains = [Path(p) for p in sorted(glob.glob(f"{root}/intel-rapl:[0-9]*")) if ":" not in Path(p).name[11:]]
        if not self.domains:
            raise OSError(f"no RAPL package domains under {root}")
        self.max_uj = [int((d / "max_energy_range_uj").read_text()) for d in self.domains]
        self.read()  # raises PermissionError when unreadable

    def read(self) -> list[int]:
        return [int((d / "energy_uj").read_text()) for d in self.domains]

    def joules_between(self, start: list[int], end: list[int]) -> float:
        total = 0
        for s, e, m in zip(start, end, self.max_uj):
            total += e - s if e >= s else e + m - s
        return total / 1e6


class EnergyMeter:
    """Measures the energy of the code between :meth:`start` and :meth:`stop`.

    Usage::

        meter = EnergyMeter(device); meter.start(); ...; result = meter.stop()
        result == {"energy_j": float | None, "energy_source": str | None,
                   "energy_unavailable_reason": str (only when energy_j is None)}

    The device should be synchronised before ``stop`` so queued work is inside the window.
    """

    def __init__(self, device: torch.device, sample_interval_s: float = 0.05,
                 rapl_root: str = "/sys/class/powercap") -> None:
        self.device = device
        self.interval = sample_interval_s
        self.rapl_root = rapl_root
        self.source: Optional[str] = None
        self.reason: Optional[str] = None
        self.nvml_mapping: Optional[str] = None  # which GPU NVML reads, and how it was found (CUDA only)
        self._handle: Any = None
        self._nvml: Any = None
        self._rapl: Optional[_RaplReader] = None
        self._start_value: Any = None
        self._samples: list[tuple[float, float]] = []
        self._stop_event = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._choose_source()

    def _choose_source(self) -> None:
        if self.device.type == "cuda":
            self._handle, how = nvml_handle(self.device)
            if self._handle is None:  # pynvml missing, NVMLError_LibraryNotFound, driver errors, no such GPU
                self.reason = f"NVML unavailable: {how}"
                return
            self._nvml, self.nvml_mapping = nvml()[0], how
            try:
                self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
                self.source = "nvml-energy-counter"
                return
            except Exception as exc:  # NVMLError_NotSupported on pre-Volta GPUs
                not_supported = exc.__class__.__name__
            try:
                self._nvml.nvmlDeviceGetPowerUsage(self._handle)
                self.source = "nvml-power-sampling"
            except Exception as exc:
                self.reason = (f"NVML energy counter ({not_supported}) and power readings "
                               f"({exc.__class__.__name__}) unsupported")
            return
        try:
            self._rapl = _RaplReader(self.rapl_root)
            self.source = "rapl"
        except (OSError, ValueError) as exc:
            self.reason = (f"no readable CPU energy counter (RAPL: {exc.__class__.__name__}: {exc}); "
                           "containers and VMs usually hide /sys/class/powercap")

    def _sample_power(self) -> None:
        while not self._stop_event.is_set():
            try:
                mw = self._nvml.nvmlDeviceGetPowerUsage(self._handle)
                self._samples.append((time.perf_counter(), mw / 1e3))
            except Exception:
                pass  # a failed sample is skipped; the integral uses the rest
            self._stop_event.wait(self.interval)

    def start(self) -> None:
        if self.source == "nvml-energy-counter":
            self._start_value = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        elif self.source == "nvml-power-sampling":
            self._samples = []
            self._stop_event.clear()
            self._thread = threading.Thread(target=self._sample_power, name="energy-sampler", daemon=True)
            self._thread.start()
        elif self.source == "rapl":
            self._start_value = self._rapl.read()

    def stop(self) -> dict[str, Any]:
        energy: Optional[float] = None
        try:
            if self.source == "nvml-energy-counter":
                # mJ → J
                energy = (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_value) / 1e3
            elif self.source == "nvml-power-sampling":
                self._stop_event.set()
                if self._thread is not None:
                    self._thread.join()
                energy = integrate_power(self._samples)
                if energy is None:
                    self.reason = "too few power samples in the window (shorter than the sampling interval)"
            elif self.source == "rapl":
                energy = self._rapl.joules_between(self._start_value, self._rapl.read())
        except Exception as exc:  # a reading failing mid-run must not crash the run
            energy, self.reason = None, f"energy reading failed ({exc.__class__.__name__}: {exc})"
        out: dict[str, Any] = {"energy_j": energy, "energy_source": self.source if energy is not None else None}
        if energy is None:
            out["energy_unavailable_reason"] = self.reason or "no energy source"
        return out


def integrate_power(samples: list[tuple[float, float]]) -> Optional[float]:
    """Trapezoidal integral (joules) of ``(time_s, watts)`` samples; None with fewer than two."""
    if len(samples) < 2:
        return None
    return float(sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(samples, samples[1:])))


def per_unit(energy: dict[str, Any], steps: int, samples: int, tokens: int) -> dict[str, Any]:
    """J/step, J/sample, J/token from an :meth:`EnergyMeter.stop` result (None + reason when unavailable)."""
    e = energy.get("energy_j")
    out: dict[str, Any] = {
        "energy_j": e,
        "energy_j_per_step": e / steps if e is not None and steps else None,
        "energy_j_per_sample": e / samples if e is not None and samples else None,
        "energy_j_per_token": e / tokens if e is not None and tokens else None,
        "energy_source": energy.get("energy_source"),
    }
    if e is None:
        out["energy_unavailable_reason"] = energy.get("energy_unavailable_reason")
    return out

"""Background GPU sampling through NVML (``pynvml`` from nvidia-ml-py): SM and memory utilisation,
memory used, power and clocks every ``interval_ms``, to CSV and a PNG plot (matplotlib).

Source: NVML API reference (nvmlDeviceGetUtilizationRates, GetMemoryInfo, GetPowerUsage, GetClockInfo).
"""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from train.errors import atomic_path
from train.perf.nvml import nvml, nvml_handle

FIELDS = ("t_s", "sm_util_pct", "mem_util_pct", "mem_used_bytes", "power_w", "sm_clock_mhz", "mem_clock_mhz")


def nvml_reader(index: int | torch.device) -> tuple[Optional[Callable[[], dict]], Optional[str]]:
    """(read() → one sample without ``t_s``, None) for CUDA device ``index``, or (None, why NVML is unavailable).

    The GPU is found by :func:`train.perf.nvml.nvml_handle` (by UUID: right under a permuted
    ``CUDA_VISIBLE_DEVICES``); ``read.nvml_mapping`` says how.
    """
    handle, how = nvml_handle(index)
    if handle is None:
        return None, f"GPU sampling skipped: {how}"
    pynvml = nvml()[0]

    def read() -> dict:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"sm_util_pct": util.gpu, "mem_util_pct": util.memory, "mem_used_bytes": mem.used,
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)}

    read.nvml_mapping = how  # type: ignore[attr-defined]
    return read, None


class GpuSampler:
    """Samples ``read()`` on a daemon thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, read: Callable[[], dict], interval_ms: int = 100) -> None:
        self.read, self.interval = read, interval_ms / 1e3
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.errors: list[str] = []

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append({"t_s": time.perf_counter() - self._t0, **self.read()})
            except Exception as exc:  # NVML can fail mid-run (e.g. power not supported); record and stop
                self.errors.append(repr(exc))
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def write(self, out_dir: Path) -> dict[str, Any]:
        """gpu_samples.csv and gpu_samples.png in ``out_dir``; returns their paths and mean values."""
        out_dir.mkdir(parents=True, exist_ok=True)
        csv_path = out_dir / "gpu_samples.csv"
        with atomic_path(csv_path) as tmp, open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.samples)
        res: dict[str, Any] = {"csv": str(csv_path), "samples": len(self.samples), "interval_ms": self.interval * 1e3}
        if self.samples:
            res["mean"] = {k: sum(s[k] for s in self.samples) / len(self.samples) for k in FIELDS[1:]}
        if self.errors:
            res["errors"] = self.errors
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            res["png"] = None
            res["png_unavailable_reason"] = "matplotlib is not installed"
            return res
        t = [s["t_s"] for s in self.samples]
        fig, axes = plt.subplots(3, 1, figsize=(8, 6), sharex=True)
        axes[0].plot(t, [s["sm_util_pct"] for s in self.samples], label="SM %")
        axes[0].plot(t, [s["mem_util_pct"] for s in self.samples], label="memory bus %")
        axes[0].set_ylabel("utilisation %")
        axes[0].legend(loc="upper right")
        axes[1].plot(t, [s["power_w"] for s in self.samples])
        axes[1].set_ylabel("power W")
        axes[2].plot(t, [s["sm_clock_mhz"] for s in self.samples])
        axes[2].set_ylabel("SM clock MHz")
        axes[2].set_xlabel("seconds since start")
        fig.tight_layout()
        png = out_dir / "gpu_samples.png"
        with atomic_path(png) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        res["png"] = str(png)
        return res

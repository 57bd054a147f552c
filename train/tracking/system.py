"""System metrics sampled by a background thread: CPU %, process RSS, and on CUDA NVML GPU figures.

At start, every ``tracking.system_interval_s`` seconds, and once more at stop, the monitor logs
``{"event": "system", ...}``:

* ``cpu_percent`` (all cores, 0–100) and ``process_cpu_percent`` (this process; 100 = one core busy),
  ``process_rss_bytes``, ``system_memory_used_bytes`` — from psutil.
* on CUDA, from NVML (``pynvml`` of the ``nvidia-ml-py`` package): ``gpu_utilization_percent``,
  ``gpu_memory_used_bytes``, ``gpu_memory_total_bytes``, ``gpu_power_w``, ``gpu_temperature_c`` — of the GPU
  :func:`train.perf.nvml.nvml_handle` finds by UUID (``CUDA_VISIBLE_DEVICES`` remapping respected).

A figure that cannot be read is absent, and ``gpu_metrics_unavailable_reason`` /
``cpu_metrics_unavailable_reason`` say why — never 0, never an exception in training.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Optional

from train.perf.nvml import nvml, nvml_handle
from train.tracking.loggers import MetricLogger


class SystemMonitor:
    """Background sampler. ``start()`` / ``stop()``; ``samples`` counts records logged.

    Args:
        logger: receives the records (must be thread-safe: JsonlLogger locks, the W&B logger queues).
        interval_s: seconds between samples (> 0).
        cuda_index: CUDA device index to read through NVML, or None on CPU runs.
    """

    def __init__(self, logger: MetricLogger, interval_s: float, cuda_index: Optional[int] = None) -> None:
        self.logger, self.interval_s = logger, interval_s
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.cpu_reason: Optional[str] = None
        self._proc = None
        self._psutil = None
        try:
            import psutil

            self._psutil, self._proc = psutil, psutil.Process()
            self._proc.cpu_percent(None)  # the first call primes the counters and returns 0.0: discard it
            psutil.cpu_percent(None)
        except Exception as exc:
            self.cpu_reason = f"psutil unavailable: {exc.__class__.__name__}: {exc}"
        self._nvml = self._handle = None
        self.gpu_mapping: Optional[str] = None  # which GPU NVML reads, and how it was found
        if cuda_index is None:
            self.gpu_reason: Optional[str] = "not a CUDA run"
        else:
            self._handle, how = nvml_handle(cuda_index)
            if self._handle is None:
                self.gpu_reason = how
            else:
                self._nvml, self.gpu_mapping, self.gpu_reason = nvml()[0], how, None

    def sample(self) -> dict[str, Any]:
        """One record (without ``step``); fields that cannot be read are left out, with a reason."""
        rec: dict[str, Any] = {"event": "system", "time_unix_s": time.time()}
        if self._proc is not None:
            try:
                rec["cpu_percent"] = self._psutil.cpu_percent(None)
                rec["process_cpu_percent"] = self._proc.cpu_percent(None)
                rec["process_rss_bytes"] = self._proc.memory_info().rss
                rec["system_memory_used_bytes"] = self._psutil.virtual_memory().used
            except Exception as exc:
                rec["cpu_metrics_unavailable_reason"] = f"psutil failed: {exc}"
        else:
            rec["cpu_metrics_unavailable_reason"] = self.cpu_reason
        if self._handle is not None:
            nv, h = self._nvml, self._handle
            reasons = []
            for key, read in (("gpu_utilization_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                              ("gpu_memory_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
                              ("gpu_memory_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total),
                              ("gpu_power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3),  # NVML: milliwatts
                              ("gpu_temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))):
                try:
                    rec[key] = read()
                except Exception as exc:  # e.g. NVMLError_NotSupported for power on some boards
                    reasons.append(f"{key}: {exc}")
            if reasons:
                rec["gpu_metrics_unavailable_reason"] = "; ".join(reasons)
        else:
            rec["gpu_metrics_unavailable_reason"] = self.gpu_reason
        return rec

    def _log_one(self) -> None:
        try:
            self.logger.log(self.sample())
            self.samples += 1
        except Exception as exc:  # never let monitoring take the run down
            if not self._failed:
                warnings.warn(f"system metrics: sampling failed ({exc}); continuing without them", stacklevel=1)
            self._failed = True

    def _run(self) -> None:
        self._log_one()  # one sample at the start, so even a run shorter than interval_s has a record
        while not self._stop.wait(self.interval_s):
            self._log_one()

    def start(self) -> None:
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits at most one sample's duration), take one last sample (the end state) and drop
        the handle. NVML itself stays initialised: :mod:`train.perf.nvml` owns it for the whole process, and an
        ``nvmlShutdown`` here would invalidate the handles the energy meter or GPU sampler still hold."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._log_one()
        self._nvml = self._handle = None

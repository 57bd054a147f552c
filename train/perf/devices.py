"""Peak FLOP/s and memory bandwidth: a table keyed by exact device name, and in-run measurement.

Table values are the vendors' dense (no sparsity) tensor-core peaks from the product datasheets
(NVIDIA H100/H200, A100, L4, L40S, A10, T4, V100 datasheets). ``fp32`` means plain FP32 (CUDA
cores); ``tf32`` applies only when ``torch.backends.cuda.matmul.allow_tf32`` is on.

The measured peak is a large square matmul timed in the run's dtype after warm-up, with device
synchronisation — correct on any device, this CPU included, and a check on the table.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any, Optional

import torch

TFLOPS = 1e12
# name → {dtype: peak FLOP/s}, plus "bandwidth_bytes_per_s"
DEVICE_TABLE: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS,
                    "bandwidth_bytes_per_s": 4.8e12},
    "NVIDIA H200 NVL": {"bf16": 835.5 * TFLOPS, "fp16": 835.5 * TFLOPS, "tf32": 417.5 * TFLOPS, "fp32": 60.0 * TFLOPS,
                        "bandwidth_bytes_per_s": 4.8e12},
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS,
                              "fp32": 66.9 * TFLOPS, "bandwidth_bytes_per_s": 3.35e12},
    "NVIDIA H100 PCIe": {"bf16": 756.0 * TFLOPS, "fp16": 756.0 * TFLOPS, "tf32": 378.0 * TFLOPS, "fp32": 51.2 * TFLOPS,
                         "bandwidth_bytes_per_s": 2.0e12},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS,
                              "bandwidth_bytes_per_s": 2.039e12},
    "NVIDIA A100-SXM4-40GB": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS,
                              "bandwidth_bytes_per_s": 1.555e12},
    "NVIDIA A100 80GB PCIe": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS,
                              "bandwidth_bytes_per_s": 1.935e12},
    "NVIDIA A100-PCIE-40GB": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS,
                              "bandwidth_bytes_per_s": 1.555e12},
    "NVIDIA L40S": {"bf16": 362.05 * TFLOPS, "fp16": 362.05 * TFLOPS, "tf32": 183.0 * TFLOPS, "fp32": 91.6 * TFLOPS,
                    "bandwidth_bytes_per_s": 0.864e12},
    "NVIDIA L4": {"bf16": 121 * TFLOPS, "fp16": 121 * TFLOPS, "tf32": 60 * TFLOPS, "fp32": 30.3 * TFLOPS,
                  "bandwidth_bytes_per_s": 0.3e12},
    "NVIDIA A10": {"bf16": 125 * TFLOPS, "fp16": 125 * TFLOPS, "tf32": 62.5 * TFLOPS, "fp32": 31.2 * TFLOPS,
                   "bandwidth_bytes_per_s": 0.6e12},
    "Tesla T4": {"fp16": 65 * TFLOPS, "fp32": 8.1 * TFLOPS, "bandwidth_bytes_per_s": 0.32e12},
    "Tesla V100-SXM2-16GB": {"fp16": 125 * TFLOPS, "fp32": 15.7 * TFLOPS, "bandwidth_bytes_per_s": 0.9e12},
    "Tesla V100-SXM2-32GB": {"fp16": 125 * TFLOPS, "fp32": 15.7 * TFLOPS, "bandwidth_bytes_per_s": 0.9e12},
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def table_entry(device_name: str) -> Optional[dict[str, float]]:
    """The :data:`DEVICE_TABLE` row of a device name as ``torch.cuda.get_device_name`` gives it, compared without
    case and surrounding/double spaces (``"NVIDIA  H200 "`` is ``"NVIDIA H200"``); None when it is not listed. Never a
    prefix match: an H200 NVL is not an H200 SXM (other clocks, other peaks)."""
    norm = " ".join(device_name.split()).casefold()
    return next((row for name, row in DEVICE_TABLE.items() if name.casefold() == norm), None)


def table_peak(device_name: str, precision: str) -> tuple[Optional[float], Optional[str]]:
    """(peak FLOP/s, None) from :data:`DEVICE_TABLE`, or (None, reason)."""
    entry = table_entry(device_name)
    if entry is None:
        return None, f"device {device_name!r} is not in the peak table (train/perf/devices.py); use the measured peak"
    key = precision
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    if key not in entry:
        return None, f"no {key} peak for {device_name} in the table"
    return entry[key], None


@lru_cache(maxsize=8)
def measured_matmul_peak(device_type: str, device_index: Optional[int], precision: str) -> float:
    """FLOP/s of the best of several large square matmuls (n=2048 on CPU, 8192 on CUDA) in ``precision``.

    Cached per (device, precision) for the life of the process.
    """
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    n = 8192 if device.type == "cuda" else 2048
    dtype = DTYPES[precision]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    reps = 10 if device.type == "cuda" else 3
    (a @ b)  # warm-up: kernel selection, allocator
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def mfu_fields(achieved_flops_per_s: Optional[float], device: torch.device, device_name: str, precision: str,
               measure: bool = True) -> dict[str, Any]:
    """``mfu`` (vs the table peak when the device is listed, else vs the measured peak), both ratios, sources.

    Returns null ratios with ``mfu_unavailable_reason`` when nothing was achieved (e.g. < 2 steps).
    """
    out: dict[str, Any] = {"achieved_flops_per_s": achieved_flops_per_s}
    peak_t, why_t = table_peak(device_name, precision)
    peak_m = measured_matmul_peak(device.type, device.index, precision) if measure else None
    out.update({"peak_flops_per_s_table": peak_t, "peak_flops_per_s_measured": peak_m})
    if why_t:
        out["mfu_vs_table_peak_unavailable_reason"] = why_t
    if achieved_flops_per_s is None:
        out.update({"mfu": None, "mfu_vs_table_peak": None, "mfu_vs_measured_peak": None,
                    "mfu_unavailable_reason": "no steady-state steps to measure"})
        return out
    out["mfu_vs_table_peak"] = achieved_flops_per_s / peak_t if peak_t else None
    out["mfu_vs_measured_peak"] = achieved_flops_per_s / peak_m if peak_m else None
    out["mfu"] = out["mfu_vs_table_peak"] if peak_t else out["mfu_vs_measured_peak"]
    out["mfu_peak_source"] = "device table" if peak_t else ("measured matmul" if peak_m else None)
    return out

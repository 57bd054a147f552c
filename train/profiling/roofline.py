"""Peak compute and bandwidth, and their ratio, the ridge point (FLOP/byte) of the roofline model.

An op whose arithmetic intensity is at or above the ridge point can be compute-bound; below it,
it is limited by memory bandwidth (Williams, Waterman & Patterson 2009). Peaks come from
``train.perf.devices.DEVICE_TABLE`` (datasheet figures, shared with MFU, keyed by ``torch.cuda.get_device_name``,
case and spacing aside) when the
device is listed, and are always also measured in-run: a large matmul (FLOP/s) and a large copy
(bytes read + written per second). On CPU only the measurement exists.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from train.perf.devices import table_entry
from train.perf.timer import Timed


def _median_seconds(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        with Timed(device) as t:  # CUDA: host-device syncs so the kernel is inside the timing
            fn()
        times.append(t.ms / 1e3)
    return sorted(times)[len(times) // 2]


def measure_peaks(device: torch.device, dtype: torch.dtype = torch.float32, matmul_n: Optional[int] = None,
                  copy_bytes: Optional[int] = None, reps: int = 5) -> dict[str, float]:
    """Measured ``{"flops_per_s", "bytes_per_s"}``: an n×n @ n×n matmul (2n³ FLOPs) and a copy of
    ``copy_bytes`` (counted twice: read + write), medians of ``reps`` synchronised runs.
    Defaults: n=1024 / 64 MiB on CPU, n=8192 / 1 GiB on CUDA."""
    cuda = device.type == "cuda"
    n = matmul_n or (8192 if cuda else 1024)
    nbytes = copy_bytes or (2**30 if cuda else 2**26)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t_mm = _median_seconds(lambda: a @ b, device, reps)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t_copy = _median_seconds(lambda: dst.copy_(src), device, reps)
    return {"flops_per_s": 2.0 * n**3 / t_mm, "bytes_per_s": 2.0 * src.numel() * 4 / t_copy,
            "matmul_n": n, "copy_bytes": int(src.numel() * 4)}


def ridge_point(device: torch.device, device_name: str, precision: str,
                measured: Optional[dict] = None) -> dict[str, Any]:
    """Peaks and ridge point (FLOP/byte) for ``device``.

    Uses the datasheet row for ``device_name`` when present (``source: "device table"``), else the
    in-run measurement (``source: "measured"``). Both are reported when both exist.
    """
    if measured is None:
        measured = measure_peaks(device, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32))
    out: dict[str, Any] = {"measured_flops_per_s": measured["flops_per_s"],
                           "measured_bytes_per_s": measured["bytes_per_s"],
                           "measured_ridge_flop_per_byte": measured["flops_per_s"] / measured["bytes_per_s"]}
    row = table_entry(device_name) if device.type == "cuda" else None
    if row is not None and precision in row:
        out.update(source="device table", device_name=device_name, peak_flops_per_s=row[precision],
                   peak_bytes_per_s=row["bandwidth_bytes_per_s"])
    else:
        out.update(source="measured", device_name=device_name, peak_flops_per_s=measured["flops_per_s"],
                   peak_bytes_per_s=measured["bytes_per_s"])
        if device.type == "cuda":
            out["device_table_unavailable_reason"] = (f"{device_name!r} ({precision}) is not in "
                                                      "train/perf/devices.py DEVICE_TABLE")
    out["ridge_flop_per_byte"] = out["peak_flops_per_s"] / out["peak_bytes_per_s"]
    return out

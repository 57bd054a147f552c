"""Peak memory: CUDA max allocated (torch caching allocator) or the process's peak RSS on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def reset_peak(device: torch.device) -> None:
    """Start a new measurement phase (CUDA only; the CPU's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """``{"peak_memory_bytes": int, "peak_memory_source": str}`` for ``device``.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only) plus ``max_memory_reserved``.
    CPU: ``ru_maxrss`` of this process (whole process, since start; KiB on Linux, bytes on macOS).
    """
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_memory_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                "peak_memory_source": "torch.cuda.max_memory_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024
    return {"peak_memory_bytes": int(rss * scale), "peak_memory_source": "process peak RSS (getrusage)"}

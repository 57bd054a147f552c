"""Version differences between the image's torch (2.1.0) and the current local torch, in one place."""

from __future__ import annotations

from typing import Any

import torch


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def make_grad_scaler(device_type: str, enabled: bool = True) -> Any:
    """A GradScaler for ``device_type``: ``torch.amp.GradScaler`` (torch ≥ 2.3) or ``torch.cuda.amp.GradScaler`` (2.1)."""
    amp_scaler = getattr(torch.amp, "GradScaler", None)
    if amp_scaler is not None:
        return amp_scaler(device_type, enabled=enabled)
    if device_type != "cuda":
        raise RuntimeError(f"torch {torch.__version__} has a GradScaler for CUDA only")
    return torch.cuda.amp.GradScaler(enabled=enabled)


def load_state(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load`` restricted to tensors and plain containers (``weights_only=True``, available since 1.13)."""
    return torch.load(path, map_location=map_location, weights_only=True)


def event_self_device_us(event: Any) -> float:
    """A profiler FunctionEvent's self device time in µs: ``self_device_time_total`` (torch ≥ 2.4) or ``self_cuda_time_total`` (2.1)."""
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0)
    return float(value or 0)


def event_device_total_us(event: Any) -> float:
    """A profiler FunctionEvent's device time including children, µs (``device_time_total`` or 2.1's ``cuda_time_total``)."""
    value = getattr(event, "device_time_total", None)
    if value is None:
        value = getattr(event, "cuda_time_total", 0)
    return float(value or 0)


def fused_adamw_supported(device: Any) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` accepts parameters on ``device``.

    torch 2.0–2.3: CUDA only; torch ≥ 2.4: CUDA and CPU (and others). Probed by constructing one,
    since the check lives in the constructor in every version.
    """
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def foreach_norm(tensors: list) -> list:
    """L2 norm of each tensor: ``torch._foreach_norm`` (fused; private API present in 2.1 and 2.13), else a loop."""
    fn = getattr(torch, "_foreach_norm", None)
    if fn is not None:
        return list(fn(tensors))
    return [t.norm() for t in tensors]

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


def foreach_norm(tensors: list) -> list:
    """L2 norm of each tensor: ``torch._foreach_norm`` (fused; private API present in 2.1 and 2.13), else a loop."""
    fn = getattr(torch, "_foreach_norm", None)
    if fn is not None:
        return list(fn(tensors))
    return [t.norm() for t in tensors]

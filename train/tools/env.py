"""Facts about the environment a run ran in, for report.json."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def git_sha() -> tuple[str | None, str | None]:
    """(sha, None) for the checkout this package lives in, or (None, reason)."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"git not runnable: {exc.__class__.__name__}"
    if out.returncode != 0:
        return None, "not a git checkout (or no commits yet)"
    return out.stdout.strip(), None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu ({name}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"


def collect_env(device: torch.device) -> dict[str, Any]:
    sha, why = git_sha()
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device_name(device),
           "device_type": device.type, "git_sha": sha, "world_size": 1}
    if why:
        env["git_sha_unavailable_reason"] = why
    return env


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA if available, else CPU. Raises UserError for an unavailable CUDA request."""
    from train.errors import UserError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"train.device={name!r} is not a device (use auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device={name!r} but CUDA is not available here; use train.device=auto or cpu")
    return dev

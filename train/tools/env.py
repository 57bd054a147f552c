"""Facts about the environment a run ran in, for report.json."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Optional

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


def cpuinfo() -> tuple[str, str]:
    """(model name, flags line) of the first processor in /proc/cpuinfo; ("", "") where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", ""
    name = flags = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value.strip()
        if name and flags:
            break
    return name, flags


def machine_load() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


PERF_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")
"""The CPU flags that decide kernel choice and precision (a bench.json records which of these the CPU has)."""


def machine_facts(device: torch.device) -> dict[str, Any]:
    """What makes two benchmark results comparable or not: CPU model and its performance flags (or the GPU's
    name), logical cores, torch threads and the 1-minute load average now."""
    name, flags = cpuinfo()
    have = set(flags.split())
    return {"cpu_model": name or platform.processor() or platform.machine(),
            "cpu_flags": [f for f in PERF_FLAGS if f in have], "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_1min": machine_load(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = cpuinfo()[0] or platform.processor() or platform.machine()
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

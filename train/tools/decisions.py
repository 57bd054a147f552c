"""Measured automatic decisions, cached per machine and settings under ``<data.cache_dir>/decisions/``.

``train.precision=auto`` (train/precision.py), ``batching.method=auto`` (train/data/batching_auto.py) and
``model.packed_attention=auto`` (train/data/attention.py), ``model.fast_dropout=auto`` (train/models/dropout.py)
and ``model.chunked_loss=auto`` (train/tasks/chunked_loss.py) each measure once; a later run whose ``fingerprint``
(machine, torch, threads, model, settings: whatever the measurement depends on) is the same reuses the answer and
says ``(cached <when> in <path>)``. A measurement taken while the machine is busy (1-minute load average above
the core count, and other processes still using at least half the cores when it ends: the load average lags a
minute behind, so right after another run ends it still counts that run) is used for that run but not cached:
other work skews the candidates differently.

A record is a JSON object with at least ``fingerprint``, ``reason``, ``measurement``, ``decided_at`` and the
decision under its own key (``mode``, ``method``, ``path``). Unreadable or foreign entries are measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Optional

from train.errors import atomic_write_text


def machine_identity(device: Any) -> dict[str, Any]:
    """What every cached ``auto`` decision is valid for on ``device`` (a ``torch.device``): the GPU's name, or the
    CPU model and a hash of its flags; the torch version; torch's thread count. The start of each fingerprint."""
    import torch

    from train.tools.env import cpuinfo

    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        name, flags = cpuinfo()
        where = f"{name or os.uname().machine} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"
    return {"device": where, "torch": torch.__version__.split("+")[0], "threads": torch.get_num_threads()}


def step_fingerprint(model: Any, precision: str, batch: dict) -> dict[str, Any]:
    """The fingerprint of a decision measured on one training step of ``model`` (a ``torch.nn.Module``) in
    ``precision`` on ``batch`` (its ``input_ids`` shape): :func:`machine_identity` of the model's device, the model
    (the wrapped module's class, its parameter count, its spec), the precision and the batch shape."""
    return {**machine_identity(next(model.parameters()).device),
            "model": [type(getattr(model, "inner", model)).__name__, sum(p.numel() for p in model.parameters()),
                      str(getattr(model, "spec", ""))], "precision": precision,
            "shape": list(batch["input_ids"].shape)}


def cache_path(cache_dir: Optional[str], kind: str, fingerprint: Any, version: int) -> Optional[str]:
    """``<cache_dir>/decisions/<kind>-<16 hex of sha256(version, fingerprint)>.json``; None without a cache dir."""
    if not cache_dir:
        return None
    key = hashlib.sha256(json.dumps([version, fingerprint], sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, "decisions", f"{kind}-{key}.json")


def read_cached(path: Optional[str], fingerprint: Any, field: str, choices: tuple[str, ...]) -> Optional[dict]:
    """The cached record at ``path`` when its fingerprint equals ``fingerprint`` and ``record[field]`` is one of
    ``choices``, with ``reason`` extended by ``(cached <when> in <path>)``; else None (measure again)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        if record.get("fingerprint") != fingerprint or record.get(field) not in choices:
            return None
        return {**record, "reason": f"{record['reason']} (cached {record['decided_at']} in {path})"}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unreadable entry is measured again


OTHERS_INTERVAL_S = 0.25
"""How long :func:`cpu_used_elsewhere` samples the CPU counters."""
_others: dict[str, float] = {}  # the latest sample of cpu_used_elsewhere: its time and value


def cpu_used_elsewhere(interval: float = OTHERS_INTERVAL_S) -> Optional[float]:
    """Cores' worth of CPU time that other processes used over the next ``interval`` seconds: the busy jiffies of
    ``/proc/stat``'s ``cpu`` line (user, nice, system, irq, softirq, steal) less this process's own CPU time
    (``os.times``), ÷ the interval. A sample under a second old is reused (one decision asks twice). None where
    ``/proc/stat`` cannot be read."""
    now = time.monotonic()
    if "at" in _others and now - _others["at"] < 1.0:
        return _others["value"]

    def sample() -> tuple[float, float, float]:
        with open("/proc/stat", encoding="ascii") as fh:
            f = [int(x) for x in fh.readline().split()[1:9]]
        own = os.times()
        return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / os.sysconf("SC_CLK_TCK"), own.user + own.system, \
            time.monotonic()
    try:
        busy0, own0, t0 = sample()
        time.sleep(interval)
        busy1, own1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    value = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-3)
    _others.update(at=time.monotonic(), value=value)
    return value


def busy_note(load: Optional[float]) -> str:
    """``"; not cached: the machine was busy (…)"`` when ``load`` (the 1-minute load average, taken before the
    measurement) exceeds the core count and other processes still use at least half the cores now
    (:func:`cpu_used_elsewhere`: the load average lags, so it still counts a run that has just ended), else ``""``."""
    cores = os.cpu_count() or 1
    if load is None or load <= cores:
        return ""
    others = cpu_used_elsewhere()
    if others is not None and others < cores / 2:
        return ""
    now = "" if others is None else f", other processes using {others:.1f} cores at its end"
    return (f"; not cached: the machine was busy (load average {load:.1f} on {cores} cores{now}), so the next run "
            "measures again")


def store(path: Optional[str], record: dict[str, Any], load: Optional[float]) -> Optional[str]:
    """Write ``record`` (plus ``decided_at``) atomically to ``path`` unless the machine was busy (:func:`busy_note`)
    or there is no path; returns the path written, or None (an unwritable cache costs a measurement next time)."""
    if not path or busy_note(load):
        return None
    try:
        atomic_write_text(path, json.dumps({**record, "decided_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())},
                                           indent=2) + "\n")
        return path
    except OSError:
        return None


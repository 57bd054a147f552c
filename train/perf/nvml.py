"""The one way to get an NVML handle for a torch CUDA device (energy, the profiler's GPU sampler, system metrics).

NVML numbers GPUs in PCI-bus order over *all* GPUs of the machine; CUDA numbers only the visible ones, in the
order of ``CUDA_VISIBLE_DEVICES``. With ``CUDA_VISIBLE_DEVICES=2,0`` CUDA device 0 is NVML device 2, so using
the CUDA index as the NVML index reads the wrong GPU. :func:`nvml_handle` maps by UUID instead.

NVML comes from ``pynvml`` as shipped by NVIDIA's ``nvidia-ml-py`` package (``train.tools.preflight`` rejects the
2017 fork ``nvidia-ml-py3``). It is initialised once per process and never shut down here: every handle handed
out stays valid for the life of the process (``nvmlShutdown`` is reference-counted against ``nvmlInit``, and one
user shutting down would invalidate the handles the others hold).

Sources: NVML API reference — ``nvmlInit``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetUUID``, ``nvmlDeviceGetHandleByUUID`` (accepts ``GPU-…`` and ``MIG-…`` strings); CUDA C
Programming Guide, "CUDA Environment Variables" (``CUDA_VISIBLE_DEVICES`` takes integers or UUID strings,
entries after the first invalid one are ignored); ``torch.cuda.get_device_properties(i).uuid``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import torch

_lock = threading.Lock()
_initialised: Any = None  # the pynvml module nvmlInit succeeded on (a test may swap the module: init again)


def nvml() -> tuple[Any, Optional[str]]:
    """``(pynvml, None)`` with NVML initialised (once per process), or ``(None, one-line reason)``."""
    global _initialised
    try:
        import pynvml  # lazy: optional dependency (nvidia-ml-py)
    except Exception as exc:  # ImportError, or a broken install
        return None, f"pynvml not importable ({exc.__class__.__name__}); pip install nvidia-ml-py"
    with _lock:
        if _initialised is not pynvml:
            try:
                pynvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound (no driver), NVMLError_DriverNotLoaded, …
                return None, f"nvmlInit failed ({exc.__class__.__name__}: {exc})"
            _initialised = pynvml
    return pynvml, None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bare_uuid(value: Any) -> str:
    """``GPU-58bd…`` / ``MIG-…`` / torch's ``58bd…`` → ``58bd…`` (lower case), for comparison."""
    text = _text(value).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _all_devices(nv: Any) -> list[tuple[int, Any, str]]:
    """``(nvml_index, handle, uuid)`` for every GPU NVML sees."""
    out = []
    for j in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(j)
        out.append((j, handle, _text(nv.nvmlDeviceGetUUID(handle))))
    return out


def _by_uuid(nv: Any, uuid: str, prefix_ok: bool = False) -> tuple[Any, Optional[str]]:
    """The handle whose NVML UUID equals ``uuid`` (or starts with it, as CUDA_VISIBLE_DEVICES allows), and its
    description; ``(None, None)`` when no GPU matches."""
    want = _bare_uuid(uuid)
    for j, handle, theirs in _all_devices(nv):
        have = _bare_uuid(theirs)
        if have == want or (prefix_ok and want and have.startswith(want)):
            return handle, f"NVML device {j} ({theirs})"
    for candidate in (f"GPU-{want}", f"MIG-{want}"):  # MIG instances are not in the top-level enumeration
        try:
            return nv.nvmlDeviceGetHandleByUUID(candidate), candidate
        except Exception:
            continue
    return None, None


def _torch_uuid(index: int) -> Optional[str]:
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)  # torch >= 2.0 on NVIDIA
    except Exception:  # no CUDA in this build/machine, or an out-of-range index
        return None
    return _text(uuid) if uuid is not None and _text(uuid) else None


def visible_devices(value: Optional[str]) -> Optional[list[str]]:
    """CUDA_VISIBLE_DEVICES as a list of entries (integers or ``GPU-``/``MIG-`` UUIDs), cut at the first
    invalid entry as CUDA does; None when unset."""
    if value is None:
        return None
    out = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.isdigit() or entry.lower().startswith(("gpu-", "mig-")):
            out.append(entry)
        else:
            break
    return out


def _by_visible_devices(nv: Any, index: int) -> tuple[Any, str]:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = visible_devices(raw)
    if entries is None:
        return None, "CUDA_VISIBLE_DEVICES unset"
    if index >= len(entries):
        return None, f"CUDA_VISIBLE_DEVICES={raw!r} lists no entry {index}"
    entry = entries[index]
    where = f"CUDA_VISIBLE_DEVICES={raw!r} entry {index}"
    try:
        if entry.isdigit():
            return nv.nvmlDeviceGetHandleByIndex(int(entry)), f"NVML device {entry} by {where}"
        handle, found = _by_uuid(nv, entry, prefix_ok=True)
    except Exception as exc:
        return None, f"{where} ({entry}): {exc.__class__.__name__}: {exc}"
    return ((handle, f"{found} by {where}") if handle is not None
            else (None, f"{where} ({entry}) matches no NVML device"))


def nvml_handle(device: torch.device | int) -> tuple[Any, str]:
    """The NVML handle of the GPU that torch calls ``device``, and how it was found.

    Returns ``(handle, mapping)`` — ``mapping`` a one line description such as ``"CUDA device 0 → NVML device 2
    (GPU-…) by UUID"`` — or ``(None, reason)`` with a one-line reason when NVML or the device is unavailable
    (not a CUDA device, pynvml not importable, ``nvmlInit`` failing, no GPU found). Never raises.
    Use the module through :func:`nvml` (or ``import pynvml``) once a handle came back.

    Mapping, first that works:

    1. UUID: ``torch.cuda.get_device_properties(i).uuid`` compared with ``nvmlDeviceGetUUID`` of each NVML
       device (then ``nvmlDeviceGetHandleByUUID`` with ``GPU-``/``MIG-`` for MIG instances). Exact whatever
       ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` say.
    2. ``CUDA_VISIBLE_DEVICES`` entry ``i``: an integer is taken as the NVML index (right when
       ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are alike: CUDA's default order is fastest first), a
       ``GPU-``/``MIG-`` string (or a unique prefix of one) is looked up by UUID.
    3. ``i`` itself as the NVML index (right when ``CUDA_VISIBLE_DEVICES`` is unset).

    ``device`` may be an integer CUDA index; a CUDA device without an index means the current device.
    """
    if isinstance(device, int):
        device = torch.device("cuda", device)
    if device.type != "cuda":
        return None, f"not a CUDA device ({device})"
    nv, why = nvml()
    if nv is None:
        return None, why
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
    except Exception as exc:
        return None, f"no current CUDA device ({exc.__class__.__name__}: {exc})"
    notes = []
    uuid = _torch_uuid(index)
    if uuid is None:
        notes.append("no UUID from torch")
    else:
        try:
            handle, found = _by_uuid(nv, uuid)
        except Exception as exc:
            handle, found = None, None
            notes.append(f"UUID lookup failed ({exc.__class__.__name__}: {exc})")
        if handle is not None:
            return handle, f"CUDA device {index} → {found} by UUID"
        notes.append(f"torch UUID {uuid} matches no NVML device")
    handle, how = _by_visible_devices(nv, index)
    if handle is not None:
        return handle, f"CUDA device {index} → {how} ({'; '.join(notes)})"
    notes.append(how)
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        notes.append(f"NVML index {index}: {exc.__class__.__name__}: {exc}")
        return None, f"no NVML handle for CUDA device {index} ({'; '.join(notes)})"
    return handle, f"CUDA device {index} → NVML device {index} by index ({'; '.join(notes)})"

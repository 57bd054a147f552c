"""Peak memory: CUDA max allocated (torch caching allocator) or the process's peak RSS on CPU."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Iterable
from typing import Any, Optional

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


def _vm_hwm_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


class WindowPeakMemory:
    """Peak memory of a window of work, resettable between windows (benchmark phases).

    CUDA: ``reset_peak_memory_stats`` then ``max_memory_allocated``/``max_memory_reserved``.
    CPU (Linux): writing ``5`` to ``/proc/self/clear_refs`` resets the peak RSS (``VmHWM``, Linux
    ≥ 4.0, proc(5)); the window's peak is read back from ``/proc/self/status``. Elsewhere the
    process-lifetime ``ru_maxrss`` is returned with a source that says it cannot be reset.
    The CPU figure is the whole process's resident memory (model, data, every benchmark arm).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable_rss = False
        if device.type != "cuda":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                _vm_hwm_bytes()
                self.resettable_rss = True
            except OSError:
                pass

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable_rss:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def stop(self) -> dict:
        if self.device.type == "cuda" or not self.resettable_rss:
            return peak_memory(self.device)
        return {"peak_memory_bytes": _vm_hwm_bytes(), "peak_memory_source": "process peak RSS in the window (VmHWM)"}


class SavedTensorMeter:
    """Activation memory of a forward pass: the bytes of the distinct storages autograd saves for the backward,
    less the model's own parameters (PyTorch's saved-tensor hooks, ``torch.autograd.graph.saved_tensors_hooks``,
    "Autograd mechanics: hooks for saved tensors"). It is what the backward holds at its start, apart from the
    weights, gradients and optimizer state; a device allocator's peak adds the temporaries of the backward on top.

    Used as a context manager around one micro-batch's forward and loss. A block under non-reentrant activation
    checkpointing saves through its own hooks (its kept inputs are not seen here), so ``bytes`` then counts what the
    rest of the model saves. A storage whose pointer cannot be read (a meta or sharded wrapper tensor) is counted in
    ``unreadable``, not in ``bytes``. ``enabled=False``: a context that counts nothing.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], enabled: bool = True) -> None:
        self.enabled = enabled
        self._exclude = set()
        for p in parameters if enabled else ():
            try:
                self._exclude.add(p.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
        self._seen: dict[int, int] = {}
        self.unreadable = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack) if enabled else None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._exclude:
                self._seen[ptr] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            self.unreadable += 1
        return t

    @property
    def bytes(self) -> int:
        """Bytes saved so far, each storage once (int)."""
        return sum(self._seen.values())

    def __enter__(self) -> "SavedTensorMeter":
        if self.enabled:
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def metered(run: Callable[[], Any], params: Iterable[torch.Tensor], enabled: bool) -> tuple[Any, Optional[int]]:
    """``(run(), bytes)``: :class:`SavedTensorMeter`'s count over ``run`` where ``enabled``, else ``(run(), None)``.
    A forward that refuses saved-tensor hooks (torch.func transforms do, e.g. the vmap that older transformers build
    their attention masks with: "torch.func transforms don't yet support saved tensor hooks") aborts before it has
    computed anything, and runs again without them: ``(run(), None)``."""
    if not enabled:
        return run(), None
    try:
        with SavedTensorMeter(params) as meter:
            out = run()
    except RuntimeError as exc:
        if "saved tensor hooks" not in str(exc):
            raise
        return run(), None
    return out, meter.bytes


def saved_tensor_bytes(run: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """``(bytes, run())``: :class:`SavedTensorMeter`'s count over ``run`` with ``params`` (the model's weights) left
    out. Under checkpointed blocks it is a lower bound (their kept inputs are not seen)."""
    with SavedTensorMeter(params) as meter:
        out = run()
    return meter.bytes, out

"""Sync audit: do steady training steps ever wait for the device? (``python -m train sync-audit``)

A real training run (``run_training``) with a callback that watches every steady step — not the first (cold)
step, not a logged step (the loop reads its on-device accumulators there, once per ``train.log_every``), not an
evaluation step — for host-device synchronisation:

* CUDA: ``torch.cuda.set_sync_debug_mode`` (``warn``: every synchronising CUDA call is recorded with its
  Python stack; ``error``: the first one raises, the run fails and the error names the call);
* CPU (no device to wait for): every host read of a tensor value (``.item()``, ``bool()``, ``float()``,
  ``.tolist()``, ``.cpu()`` …), the reads that would be syncs on CUDA, counted by a ``TorchFunctionMode``;
  reads inside the data pipeline (collate, DataLoader) are left out: those tensors are on the host on CUDA too.

Writes ``--out`` (JSON): ``watched_steps``, ``host_syncs`` (count), ``first_syncs`` (up to 5: step and stack),
``method``, ``passed`` (``host_syncs == 0``), and the run's ``report_path``. Exit 0 when passed, 1 otherwise.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from train.callbacks import Callback

HOST_READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu"})


class HostReads(TorchFunctionMode):
    """Calls ``on_read(name)`` for every read of a tensor value by the host (a host-device sync on CUDA)."""

    def __init__(self, on_read) -> None:
        super().__init__()
        self.on_read = on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.on_read(name)
        return func(*args, **(kwargs or {}))


DATA_PIPELINE = ("/train/data/", "/torch/utils/data/")


AUDIT_FILES = ("host_syncs", "sync_audit")
"""The audit's own modules (this one and train/run/sync_audit.py): left out of a sync's stack."""


def _stack() -> list[str]:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/train/" in f.filename and not any(own in f.filename for own in AUDIT_FILES)]
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]


def _in_data_pipeline() -> bool:
    return any(part in f.filename for f in traceback.extract_stack() for part in DATA_PIPELINE)


class SyncAudit(Callback):
    """Watches steady steps for host-device syncs (see the module docstring). Attach with :meth:`attach`.

    Args:
        mode: ``warn`` (record every sync) or ``error`` (CUDA: the first sync raises RuntimeError).
    """

    def __init__(self, mode: str = "warn") -> None:
        if mode not in ("warn", "error"):
            raise ValueError("mode must be 'warn' or 'error'")
        self.mode = mode
        self.watched_steps = 0
        self.host_syncs = 0
        self.first_syncs: list[dict[str, Any]] = []
        self._step: Optional[int] = None
        self._ctx: Any = None
        self._trainer: Any = None

    # -- the hook protocol of run_training ---------------------------------------------------------------------
    def attach(self, trainer: Any, run_dir: Path) -> None:
        self._trainer = trainer
        trainer.add_callback(self)

    def finish(self, report: dict[str, Any]) -> None:
        report["sync_audit"] = self.result()

    # -- callback events ---------------------------------------------------------------------------------------
    def _watched(self, step: int) -> bool:
        t = self._trainer
        cfg = t.cfg.train
        logged = step % cfg.log_every == 0 or step == t.total_steps
        evaluated = t.eval_loader is not None and (step % cfg.eval_every == 0 or step == t.total_steps)
        return step > t.start_step + 1 and not logged and not evaluated

    def on_step_start(self, step: int) -> None:
        if not self._watched(step):
            return
        self._step = step
        self.watched_steps += 1
        if self._trainer.device.type == "cuda":
            self._ctx = warnings.catch_warnings(record=False)
            self._ctx.__enter__()
            warnings.simplefilter("always")
            self._showwarning = warnings.showwarning
            warnings.showwarning = self._cuda_warning
            torch.cuda.set_sync_debug_mode(self.mode)
        else:
            self._ctx = HostReads(lambda name: None if _in_data_pipeline() else self._record(name))
            self._ctx.__enter__()

    def on_step_end(self, step: int, step_ms: Optional[float]) -> bool:
        if self._step == step and self._ctx is not None:
            if self._trainer.device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = self._showwarning
            self._ctx.__exit__(None, None, None)
            self._ctx, self._step = None, None
        return False

    def _cuda_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        # torch warns "called a synchronizing CUDA operation"; set_sync_debug_mode's one-time notice ("Synchronization
        # debug mode is a prototype feature ...") is said when the audit turns the mode on, and is no sync
        if "synchroniz" in str(message) and "prototype feature" not in str(message):
            self._record(str(message).splitlines()[0][:200])
        else:
            self._showwarning(message, category, filename, lineno, file, line)

    def _record(self, what: str) -> None:
        self.host_syncs += 1
        if len(self.first_syncs) < 5:
            self.first_syncs.append({"step": self._step, "what": what, "stack": _stack()})

    def result(self) -> dict[str, Any]:
        device = self._trainer.device.type if self._trainer is not None else None
        method = (f"torch.cuda.set_sync_debug_mode({self.mode!r})" if device == "cuda"
                  else "host reads of tensor values (TorchFunctionMode), the reads that sync on CUDA")
        return {"watched_steps": self.watched_steps, "host_syncs": self.host_syncs, "first_syncs": self.first_syncs,
                "method": method, "device": device, "passed": self.watched_steps > 0 and self.host_syncs == 0}

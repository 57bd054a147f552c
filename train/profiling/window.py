"""The torch.profiler window: a wait/warm-up/active schedule around real training steps.

Attached to a :class:`~train.trainer.Trainer`, it swaps in ``record_function`` (and, on CUDA, NVTX)
ranges, starts ``torch.profiler.profile`` before step 1 and calls ``prof.step()`` at the end of each
step; when the active steps are done it exports a gzipped Chrome/Perfetto trace, keeps the grouped op
records and stage times, and removes itself (the ranges go back to the no-op default).
Source: torch.profiler.profile / schedule (PyTorch docs, "PyTorch Profiler" recipe).
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity

from train.callbacks import Callback
from train.compat import event_device_total_us
from train.config import ProfileConfig
from train.errors import atomic_path
from train.profiling.native_noise import filtered_stderr
from train.profiling.ops import OpRecord, collect_ops
from train.profiling.ranges import RANGE_PREFIX, STAGES, ProfilerRanges, null_ranges


def gzip_file(src: Path, dst: Path) -> int:
    """gzip ``src`` into ``dst`` atomically; returns the compressed size in bytes."""
    with atomic_path(dst) as tmp, open(src, "rb") as fin, gzip.open(tmp, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, length=1 << 20)
    return dst.stat().st_size


class TorchProfileWindow(Callback):
    """Profiles training steps ``wait + warmup + 1 … wait + warmup + active`` (1-based).

    Needs every step's duration (``needs_step_ms``): while attached, each step waits for the device.

    After the window: ``ops`` (list of :class:`OpRecord`), ``step_us`` (wall µs per active step),
    ``stage_us`` (µs per stage summed over the active steps: CPU wall time on CPU, device time
    launched inside the range on CUDA), ``trace`` (path, bytes, cap) and ``tokens`` (real/padded
    tokens of the active steps).
    """

    needs_step_ms = True

    def __init__(self, cfg: ProfileConfig, out_dir: Path, device: torch.device) -> None:
        self.cfg, self.out_dir, self.device = cfg, out_dir, device
        self.first_active = cfg.wait + cfg.warmup + 1
        self.last_step = cfg.wait + cfg.warmup + cfg.active
        self.ops: list[OpRecord] = []
        self.step_us: list[float] = []
        self.stage_us: dict[str, float] = {}
        self.timer_ms: list[float] = []
        self.trace: dict[str, Any] = {}
        self.tokens: dict[str, int] = {}
        self.done = False
        self._prof: Optional[torch.profiler.profile] = None
        self._trainer = None
        self._tok0 = (0, 0)

    def attach(self, trainer) -> None:
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._trainer = trainer
        trainer.set_ranges(ProfilerRanges(nvtx=cuda))
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.cfg.wait, warmup=self.cfg.warmup, active=self.cfg.active,
                                             repeat=1),
            record_shapes=True, with_flops=True, profile_memory=True, on_trace_ready=self._ready)
        with filtered_stderr():
            self._prof.start()
        trainer.add_callback(self)

    def on_step_end(self, step: int, step_ms: float) -> bool:
        s = self._trainer.stats
        if step == self.first_active - 1:
            self._tok0 = (s.real_tokens, s.padded_tokens)
        if self.first_active <= step <= self.last_step:
            self.timer_ms.append(step_ms)
        with filtered_stderr():  # the schedule starts and stops the profiler inside step()
            self._prof.step()
        if step >= self.last_step:
            self.tokens = {"real_tokens": s.real_tokens - self._tok0[0],
                           "padded_tokens": s.padded_tokens - self._tok0[1]}
            self.close()
        return False

    def close(self) -> None:
        """Stop the profiler (idempotent) and restore the no-op ranges."""
        if self._prof is not None:
            with filtered_stderr():
                self._prof.stop()
            self._prof = None
        if self._trainer is not None:
            self._trainer.set_ranges(null_ranges)
            self._trainer.remove_callback(self)
        self.done = True

    def _ready(self, prof: torch.profiler.profile) -> None:
        events = prof.events()
        cuda = self.device.type == "cuda"
        self.step_us = [float(e.cpu_time_total) for e in events if e.name.startswith("ProfilerStep")]
        stage_us = dict.fromkeys(STAGES, 0.0)
        for e in events:
            if e.name.startswith(RANGE_PREFIX) and e.name[len(RANGE_PREFIX):] in stage_us:
                stage = e.name[len(RANGE_PREFIX):]
                stage_us[stage] += event_device_total_us(e) if cuda else float(e.cpu_time_total)
        self.stage_us = stage_us
        self.ops = collect_ops(events)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / ".trace.json"
        dst = self.out_dir / "trace.json.gz"
        try:
            prof.export_chrome_trace(str(raw))
            raw_bytes = raw.stat().st_size
            size = gzip_file(raw, dst)
        finally:
            raw.unlink(missing_ok=True)
        cap = int(self.cfg.max_trace_mb * 2**20)
        self.trace = {"path": str(dst), "bytes": size, "uncompressed_bytes": raw_bytes, "cap_bytes": cap,
                      "active_steps": self.cfg.active, "within_cap": size <= cap}
        if size > cap:
            os.unlink(dst)
            self.trace["path"] = None
            self.trace["path_unavailable_reason"] = (f"trace was {size / 2**20:.1f} MiB > "
                                                     f"profile.max_trace_mb={self.cfg.max_trace_mb:g}; "
                                                     "deleted: lower profile.active")

"""Builds a run's tracking from ``cfg.tracking``: one :class:`~train.tracking.FanOut` for the loop,
plus the system-metrics thread, the gradient-statistics hook and the report.json ``tracking`` section.

    tracking = Tracking(cfg, run_dir)            # metrics.jsonl opened; W&B starts initialising in the background
    logger = tracking.attach(model, device)      # FanOut(jsonl[, wandb]); system metrics start
    trainer = Trainer(..., logger=logger)
    trainer.add_callback(GradStatsCallback(tracking.grad_stats, trainer))   # when grad stats are on
    tracking.close(); report["tracking"] = tracking.report()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from train.config import RunConfig
from train.tracking.gradstats import GradStats
from train.tracking.loggers import FanOut, JsonlLogger, MetricLogger
from train.tracking.system import SystemMonitor
from train.tracking.wandb_logger import WandbLogger, resolve_mode


class Tracking:
    """Owns every logger of one run. Only ``close()`` waits on W&B, and only for a bounded time."""

    def __init__(self, cfg: RunConfig, run_dir: Path, run_name: Optional[str] = None, **wandb_kwargs: Any) -> None:
        t = cfg.tracking
        self.cfg = t
        self.jsonl = JsonlLogger(Path(run_dir) / "metrics.jsonl")
        self.mode, self.wandb_note = resolve_mode(t)
        self.wandb: Optional[WandbLogger] = None
        if self.mode is not None:
            self.wandb = WandbLogger(t, self.mode, Path(run_dir), run_name or Path(run_dir).name, cfg.to_dict(),
                                     **wandb_kwargs)
        self.grad_stats = (GradStats(t.grad_stats_every, cfg.optim.clip_norm, cfg.train.log_every)
                           if t.grad_stats_every else None)
        self.monitor: Optional[SystemMonitor] = None
        self.logger: MetricLogger = self.jsonl
        self._closed = False

    def attach(self, model: torch.nn.Module, device: torch.device) -> MetricLogger:
        """Start system metrics, ``wandb.watch`` when configured (waits for init, bounded); return the FanOut."""
        loggers: list[MetricLogger] = [self.jsonl]
        if self.wandb is not None:
            self.wandb.watch(model)
            loggers.append(self.wandb)
        self.logger = FanOut(*loggers)
        if self.cfg.system_interval_s > 0:
            cuda_index = (device.index if device.index is not None else torch.cuda.current_device()) \
                if device.type == "cuda" else None
            self.monitor = SystemMonitor(self.logger, self.cfg.system_interval_s, cuda_index)
            self.monitor.start()
        return self.logger

    def close(self) -> None:
        """Stop the system thread, flush W&B (bounded), close metrics.jsonl. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.monitor is not None:
            self.monitor.stop()
        if self.wandb is not None:
            self.wandb.close()
        self.jsonl.close()

    def report(self) -> dict[str, Any]:
        """The report.json ``tracking`` section (keys are a contract: add, never rename)."""
        out: dict[str, Any] = {"metrics_jsonl": str(self.jsonl.path), "wandb_requested": self.cfg.wandb}
        if self.wandb is not None:
            out.update(self.wandb.status())
        else:
            out.update({"wandb_active": False, "wandb_mode": None, "wandb_dir": None, "wandb_fallback_reason": None,
                        "dropped_records": 0})
        out["wandb_note"] = self.wandb_note
        m = self.monitor
        out["system_interval_s"] = self.cfg.system_interval_s or None
        out["system_samples"] = m.samples if m is not None else 0
        if m is not None:
            out["gpu_metrics_unavailable_reason"] = m.gpu_reason
            out["cpu_metrics_unavailable_reason"] = m.cpu_reason
        out["grad_stats_every"] = self.cfg.grad_stats_every or None
        out["grad_stats_records"] = self.grad_stats.records if self.grad_stats is not None else 0
        return out

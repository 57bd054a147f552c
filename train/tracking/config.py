"""``tracking.*`` settings: JSONL, W&B, system metrics, gradient statistics (composed into RunConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from train.errors import UserError


@dataclass
class TrackingConfig:
    """Experiment tracking beside metrics.jsonl (always written): W&B, system metrics, gradient statistics.

    The scalar cadence is ``train.log_every``. See train/tracking/wandb_logger.py and README "Experiment tracking".
    """

    wandb: Union[str, bool] = "auto"
    """``auto`` (W&B when the package imports, else JSONL only, silently), ``on`` (W&B; a warning if it fails), ``off``.
    (YAML reads on/off as booleans; true/false are accepted as on/off.)"""
    mode: str = "auto"
    """W&B mode: ``auto`` ($WANDB_MODE if set, else ``offline``), ``offline``, or ``online`` (needs an API key:
    $WANDB_API_KEY or ``wandb login``; without one the run logs offline). ``WANDB_MODE=disabled`` turns W&B off."""
    project: str = "deep-model-perf"
    """W&B project name."""
    init_timeout_s: float = 60.0
    """Longest the run waits for ``wandb.init`` (which starts while the data is prepared); then JSONL only."""
    finish_timeout_s: float = 30.0
    """Longest the run waits at the end for queued W&B records and ``wandb.finish``."""
    queue_size: int = 10000
    """Records waiting for the W&B thread; when full, new records are dropped and counted (never blocks)."""
    watch: Union[str, bool] = "off"
    """``wandb.watch(model, log=…)``: ``off``, ``gradients``, ``parameters`` or ``all`` (histograms; the hooks run
    in the training thread)."""
    watch_log_freq: int = 100
    """``wandb.watch`` log_freq: histograms every N backward passes."""
    system_interval_s: float = 5.0
    """Seconds between system-metric samples (CPU %, RSS; NVML GPU utilisation/memory/power); 0 = off."""
    grad_stats_every: int = 10
    """Per-layer gradient norm/std record (``"event": "grad_stats"``) every N logged records; 0 = off."""

    def __post_init__(self) -> None:
        if isinstance(self.wandb, bool):
            self.wandb = "on" if self.wandb else "off"
        if isinstance(self.watch, bool):
            self.watch = "gradients" if self.watch else "off"
        if self.wandb not in ("auto", "on", "off"):
            raise UserError(f"tracking.wandb={self.wandb!r} is not one of auto, on, off")
        if self.mode not in ("auto", "offline", "online"):
            raise UserError(f"tracking.mode={self.mode!r} is not one of auto, offline, online")
        if self.watch not in ("off", "gradients", "parameters", "all"):
            raise UserError(f"tracking.watch={self.watch!r} is not one of off, gradients, parameters, all")
        if self.init_timeout_s <= 0 or self.finish_timeout_s <= 0:
            raise UserError("tracking.init_timeout_s and tracking.finish_timeout_s must be > 0")
        if self.queue_size < 1 or self.watch_log_freq < 1:
            raise UserError("tracking.queue_size and tracking.watch_log_freq must be ≥ 1")
        if self.system_interval_s < 0 or self.grad_stats_every < 0:
            raise UserError("tracking.system_interval_s and tracking.grad_stats_every must be ≥ 0 (0 = off)")

"""``tracking.*`` settings: JSONL, W&B, system metrics, gradient statistics (composed into RunConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from train.errors import Frozen, allowed, check_fields


@dataclass
class TrackingConfig(Frozen):
    """Experiment tracking beside metrics.jsonl (always written): W&B, system metrics, gradient statistics.

    The scalar cadence is ``train.log_every``. See train/tracking/wandb_logger.py and README "Experiment tracking".
    """

    wandb: Union[str, bool] = allowed("auto", choices=("auto", "on", "off"))
    """``auto`` (W&B when the package imports, else JSONL only, silently), ``on`` (W&B; a warning if it fails), ``off``.
    (YAML reads on/off as booleans; true/false are accepted as on/off.)"""
    mode: str = allowed("auto", choices=("auto", "offline", "online"))
    """W&B mode: ``auto`` ($WANDB_MODE if set, else ``offline``), ``offline``, or ``online`` (needs an API key:
    $WANDB_API_KEY or ``wandb login``; without one the run logs offline). ``WANDB_MODE=disabled`` turns W&B off."""
    project: str = "deep-model-perf"
    """W&B project name."""
    init_timeout_s: float = allowed(60.0, gt=0)
    """Longest the run waits for ``wandb.init`` (which starts while the data is prepared); then JSONL only."""
    finish_timeout_s: float = allowed(30.0, gt=0)
    """Longest the run waits at the end for queued W&B records and ``wandb.finish``."""
    queue_size: int = allowed(10000, ge=1)
    """Records waiting for the W&B thread; when full, new records are dropped and counted (never blocks)."""
    watch: Union[str, bool] = allowed("off", choices=("off", "gradients", "parameters", "all"))
    """``wandb.watch(model, log=…)``: ``off``, ``gradients``, ``parameters`` or ``all`` (histograms; the hooks run
    in the training thread)."""
    watch_log_freq: int = allowed(100, ge=1)
    """``wandb.watch`` log_freq: histograms every N backward passes."""
    system_interval_s: float = allowed(5.0, ge=0)
    """Seconds between system-metric samples (CPU %, RSS; NVML GPU utilisation/memory/power); 0 = off."""
    grad_stats_every: int = allowed(10, ge=0)
    """Per-layer gradient norm/std record (``"event": "grad_stats"``) every N logged records; 0 = off."""

    def __post_init__(self) -> None:
        if isinstance(self.wandb, bool):
            self.wandb = "on" if self.wandb else "off"
        if isinstance(self.watch, bool):
            self.watch = "gradients" if self.watch else "off"
        check_fields(self, "tracking")

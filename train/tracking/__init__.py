"""Experiment tracking: JSONL / null / fan-out loggers (``loggers``), the W&B logger (``wandb_logger``), the
run's tracking set-up (``run_tracking``), system metrics (``system``), per-layer gradient statistics (``gradstats``),
``compare`` and ``wandb-sync`` (``compare``, ``sync``)."""

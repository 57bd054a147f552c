"""``python -m train sync-audit``: a real training run watched by :class:`~train.perf.host_syncs.SyncAudit` (do steady
steps ever wait for the device?); writes the audit's JSON. The command exits 0 when no steady step synced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from train.config import RunConfig
from train.perf.host_syncs import SyncAudit
from train.run.training import run_training


def run_sync_audit(cfg: RunConfig, mode: str, out: Optional[str], t_start: float) -> dict[str, Any]:
    """Train ``cfg`` with a :class:`SyncAudit` in ``mode`` (``warn`` or ``error``); write its result to ``out``
    (default: ``<run dir>/sync_audit.json``) and return it, with ``report_path`` and ``path`` (where it was written)."""
    audit = SyncAudit(mode)
    report = run_training(cfg, t_start, hooks=(audit,))
    result = {**audit.result(), "report_path": str(Path(report["run_dir"]) / "report.json")}
    path = Path(out) if out else Path(report["run_dir"]) / "sync_audit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return {**result, "path": str(path)}

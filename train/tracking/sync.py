"""``python -m train wandb-sync``: upload offline W&B runs under ``runs/`` with ``wandb sync``.

Finds ``<runs_root>/*/wandb/offline-run-*`` directories that W&B has not marked as synced
(``wandb sync`` leaves a ``*.wandb.synced`` file beside the run's ``.wandb`` file) and passes them to
``wandb sync`` in one call. Needs an API key ($WANDB_API_KEY or ``wandb login``) and the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from train.errors import UserError
from train.tracking.wandb_logger import has_api_key


def offline_runs(runs_root: str | Path, include_synced: bool = False) -> list[Path]:
    """Offline W&B run directories under ``runs_root`` (sorted), without the already synced ones unless asked."""
    found = sorted(p for p in Path(runs_root).glob("*/wandb/offline-run-*") if p.is_dir())
    if include_synced:
        return found
    return [p for p in found if not any(p.glob("*.wandb.synced"))]


def sync(runs_root: str = "runs", include_synced: bool = False, dry_run: bool = False) -> int:
    """Run ``wandb sync`` on the unsynced offline runs. Returns the process exit code (0 when nothing to do).

    Raises:
        UserError: no API key, or wandb is not installed.
    """
    runs = offline_runs(runs_root, include_synced)
    if not runs:
        print(f"nothing to sync: no unsynced offline W&B runs under {runs_root}/ "
              "(runs log offline by default; train with tracking.wandb=on)")
        return 0
    cmd = [sys.executable, "-m", "wandb", "sync", *map(str, runs)]
    print(f"{len(runs)} offline run(s) to sync:\n" + "\n".join(f"  {p}" for p in runs))
    if dry_run:
        print("dry run: " + " ".join(cmd))
        return 0
    if not has_api_key(dict(os.environ)):
        raise UserError("no W&B API key: run `wandb login` or set WANDB_API_KEY, then make wandb-sync again")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError("wandb is not installed here; `make setup` installs the pinned version") from None
    return subprocess.run(cmd).returncode

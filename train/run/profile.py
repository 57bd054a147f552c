"""``python -m train profile``: the profile command — one real training run with the requested captures attached
(:class:`~train.profiling.session.ProfileSession`), then Nsight Systems as a second run when asked for and usable."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from train.config import RunConfig
from train.profiling.nsys import StaleExportError, export_stats, nsys_available, profile_command
from train.profiling.session import ProfileSession, steps_needed, write_summary
from train.run.training import run_training


def run_profile(cfg: RunConfig, tools: list[str], t_start: float, child_args: list[str]) -> dict[str, Any]:
    """Run the in-process tools as one training run, then nsys as a second run when requested and usable.

    ``child_args``: the ``--config``/override arguments to pass on to the nsys child run.
    Returns the report of the in-process run (or a small dict when only nsys ran or was skipped).
    """
    in_process = [t for t in tools if t != "nsys"]
    report: dict[str, Any] = {}
    if not cfg.train.run_id:  # the default place holds the latest profile: replaced on every run
        cfg = cfg.with_values({"train.run_id": "profile", "train.overwrite": True})
    run_id = cfg.train.run_id
    if in_process:
        steps = steps_needed(cfg, in_process)
        cfg = cfg.with_values({"train.max_steps": steps, "train.eval_every": steps})
        report = run_training(cfg, t_start, hooks=(ProfileSession(cfg, in_process),))
    if "nsys" in tools:
        nsys, why = nsys_available()
        if nsys is None:
            print(why, flush=True)
            report.setdefault("profile", {}).setdefault("skipped", {})["nsys"] = why
            _fold(Path(cfg.train.output_dir) / run_id / "profile", {"skipped": {"nsys": why}})
        else:
            report["nsys"] = run_nsys(cfg, nsys, run_id, child_args)
    return report


def run_nsys(cfg: RunConfig, nsys: str, run_id: str, child_args: list[str]) -> dict[str, Any]:
    """A child training run under ``nsys profile``; its stats are folded into ``runs/<run_id>/profile/summary.*``."""
    out = Path(cfg.train.output_dir) / run_id / "profile" / "nsys"
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "trace"
    started = time.time()
    child = [sys.executable, "-m", "train", "profile", "--tools", "nsys-capture", "--run-id", f"{run_id}-nsys",
             *child_args, "train.overwrite=true"]
    cmd = profile_command(nsys, prefix, child)
    print("nsys: " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd)
    result: dict[str, Any]
    if proc.returncode != 0:
        result = {"error": f"nsys profile exited {proc.returncode}", "command": cmd}
    else:
        try:
            result = export_stats(nsys, prefix.with_suffix(".nsys-rep"), started)
        except (StaleExportError, RuntimeError) as exc:
            result = {"error": str(exc)}
    _fold(out.parent, {"nsys": result})
    return result


def _fold(out_dir: Path, extra: dict[str, Any]) -> None:
    """Merge ``extra`` into an existing summary.json (or start one) and re-render summary.md."""
    path = out_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(summary.get(k), dict):
            summary[k].update(v)
        else:
            summary[k] = v
    out_dir.mkdir(parents=True, exist_ok=True)
    write_summary(out_dir, summary)

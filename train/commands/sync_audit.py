"""``python -m train.commands.sync_audit``: a real training run watched by :class:`~train.perf.host_syncs.SyncAudit`
(do steady steps ever wait for the device?); writes the audit's JSON and exits 0 when no steady step synced."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

from train.commands.train import run_training
from train.perf.host_syncs import SyncAudit


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m train.commands.sync_audit --config C [--mode warn|error] [--out PATH] [section.key=value …]``."""
    from train.config import load_config

    p = argparse.ArgumentParser(prog="python -m train.commands.sync_audit", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("--mode", default="warn", choices=("warn", "error"))
    p.add_argument("--out", default=None, help="result JSON (default: <run dir>/sync_audit.json)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    cfg = load_config(args.config, args.overrides)
    audit = SyncAudit(args.mode)
    report = run_training(cfg, t0, hooks=(audit,))
    result = {**audit.result(), "report_path": str(Path(report["run_dir"]) / "report.json")}
    out = Path(args.out) if args.out else Path(report["run_dir"]) / "sync_audit.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"sync audit: {result['host_syncs']} host sync(s) in {result['watched_steps']} steady steps "
          f"({result['method']}): {'PASS' if result['passed'] else 'FAIL'}; wrote {out}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

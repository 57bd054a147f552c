"""An A/B of a few configurations measured in a fresh Python process: ``optimize-grid``'s final.

Why: arms timed in a process that has built, stepped and closed a hundred others do not run at their own speed
(docs/optimize.md, "The exhaustive grid"); whatever the cause — the process's heap and caches after the screening
are the suspects —, a new process holds nothing but the arms it measures.

:func:`measure_in_fresh_process` writes a spec (the resolved config file, each arm's overrides, the rounds and the
window) to ``work_dir/spec.json`` and runs ``python -m train.optimize.isolated work_dir/spec.json``; the
child prepares the data (from the same cache), builds the arms with :class:`~train.optimize.backend.
RunBackend`, warms each up, interleaves them (:class:`~train.optimize.arms.ArmSet`, as the search's A/Bs
and the grid's screening do) and writes ``work_dir/result.json`` (temp file, then rename); its output goes to
``work_dir/child.log``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from train.config import load_config
from train.data import prepare_data
from train.errors import UserError, atomic_write_text
from train.optimize.arms import ArmSet
from train.optimize.backend import RunBackend
from train.perf.ab import ABResult
from train.setup import apply_threads_and_seed
from train.tools.env import resolve_device


class IsolatedFailure(RuntimeError):
    """The child process failed, timed out or wrote no result; the message names its log."""


def measure_in_fresh_process(config_path: Path, arms: dict[str, dict[str, Any]], *, rounds: int,
                             window_samples: int, warmup_samples: int, work_dir: Path, timeout_s: float,
                             python: Optional[str] = None) -> ABResult:
    """Measure ``arms`` (name → overrides on the config at ``config_path``) interleaved in a new process.

    ``rounds`` timed rounds of ``window_samples`` samples per arm after ``warmup_samples`` untimed samples each;
    ``timeout_s`` bounds the whole child (build, data, warm-up, rounds).

    Raises:
        IsolatedFailure: the child exited non-zero, ran past ``timeout_s`` or wrote an unreadable result (the
            message has the last lines of ``work_dir/child.log``).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = {"config": str(config_path), "arms": arms, "rounds": rounds, "window_samples": window_samples,
            "warmup_samples": warmup_samples}
    spec_path, result_path, log_path = work_dir / "spec.json", work_dir / "result.json", work_dir / "child.log"
    atomic_write_text(spec_path, json.dumps(spec, indent=2, default=str) + "\n")
    result_path.unlink(missing_ok=True)
    cmd = [python or sys.executable, "-m", "train.optimize.isolated", str(spec_path)]
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise IsolatedFailure(f"{log_path}: ran past {timeout_s:.0f} s (optimize.arm_timeout_s)") from None
    if rc != 0:
        tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
        raise IsolatedFailure(f"{log_path}: exit code {rc}: {tail}")
    try:
        return ABResult.from_dict(json.loads(result_path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise IsolatedFailure(f"{result_path}: no readable result ({type(e).__name__}: {e})") from None


def _child(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    cfg = load_config(spec["config"])
    cfg = cfg.with_values({}).freeze() if not cfg.frozen else cfg
    device = resolve_device(cfg.train.device)
    apply_threads_and_seed(cfg)
    out_dir = spec_path.parent
    bundle = prepare_data(cfg, None, notice=lambda m: print(m, flush=True))
    backend = RunBackend(cfg, bundle, device, out_dir, notice=lambda m: print(m, flush=True))
    with ArmSet(backend, device) as arms:
        for name, settings in spec["arms"].items():
            arms.build(name, settings)
        for name in spec["arms"]:
            arms.warm(name, int(spec["warmup_samples"]))
        result = arms.interleave(int(spec["rounds"]), int(spec["window_samples"]),
                                 on_round=lambda r: print(f"round {r + 1}/{spec['rounds']}", flush=True))
    atomic_write_text(out_dir / "result.json", json.dumps(result.as_dict(), indent=2) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m train.optimize.isolated <spec.json>", file=sys.stderr)
        return 2
    try:
        _child(Path(argv[0]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

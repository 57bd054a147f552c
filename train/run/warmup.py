"""``python -m train warmup``: build the run, warm every planned shape, write ``runs/<id>/warmup.json``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from train.compiling.warmup import plan_all_shapes, warm_up_for_run
from train.config import dump_config
from train.data import prepare_data
from train.errors import Interrupted, UserError, atomic_write_text
from train.parallel.process_group import DistContext
from train.resolve import resolve_run
from train.setup import apply_threads_and_seed, build_run
from train.shutdown import ShutdownRequest
from train.tools.env import resolve_device
from train.tools.run_dir import make_run_dir, unlock_run_dir


def run_warmup(cfg: Any, buckets_force: bool = False) -> dict[str, Any]:
    """``python -m train warmup``: build the run's model and bucket plan, warm every shape, write
    ``runs/<id>/warmup.json``.

    Compiles when ``compile.enabled`` resolves on (``make warmup`` passes ``compile.enabled=true``);
    otherwise warms the eager shapes and says why. SIGTERM/SIGINT at any point (data preparation, set-up, warm-up)
    stops at once with :class:`~train.errors.Interrupted` (one line, exit 128 + signal), and a run directory this
    command created is removed (nothing was written that a later command could use).

    Raises:
        UserError: bad input.
        Interrupted: a signal arrived.
    """
    existed = bool(cfg.train.run_id) and (Path(cfg.train.output_dir) / cfg.train.run_id).exists()
    run_dir = None
    with ShutdownRequest(cfg.train.shutdown_timeout_s, immediate=True) as shutdown:
        try:
            shutdown.phase = "set-up"
            run_dir, device = make_run_dir(cfg), resolve_device(cfg.train.device)
            apply_threads_and_seed(cfg)
            shutdown.phase = "data preparation"
            bundle = prepare_data(cfg, run_dir, buckets_force)
            shutdown.phase = "model set-up"  # the run's own decisions: the shapes warmed are the ones it trains
            resolved = resolve_run(cfg, run_dir.name, bundle, device, DistContext())
            atomic_write_text(run_dir / "config.yaml", dump_config(resolved.cfg))
            run = build_run(resolved.cfg, resolved.bundle, device, resolved.policy, model=resolved.model,
                            splits=("train", "validation", "test"), compile=True)
            shutdown.phase = "compile warm-up"
            result = _warm(resolved.cfg, run, run_dir)
        except (Interrupted, UserError) as exc:  # nothing a later command could use: a new run directory goes
            if run_dir is not None and not existed:
                unlock_run_dir(run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
                exc.args = (f"{exc.args[0]}; removed {run_dir}",) if isinstance(exc, Interrupted) else exc.args
            raise
    return result


def _warm(cfg: Any, run: Any, run_dir: Path) -> dict[str, Any]:
    """Warm the built run's shapes (the eager ones when compile is off) and write warmup.json; returns it."""
    session, loaders = run.compiled, run.loaders
    if not session.enabled:
        print(f"compile is off ({session.reason}); warming the eager shapes only", flush=True)
        session.shapes = plan_all_shapes(loaders["train"], [loaders["validation"], loaders["test"]]
                                         if cfg.compile.warmup_eval else ())
    result = warm_up_for_run(session, run.trainer, run.model, run_dir, force=True)
    if result is None:
        raise UserError(f"nothing to warm up: {session.warmup_skipped_reason}")
    for line in session.loud_warnings():
        print(line, flush=True)
    result["path"] = str(run_dir / "warmup.json")
    return result

"""``python -m train warmup``: build the run, warm every planned shape, write ``runs/<id>/warmup.json``."""

from __future__ import annotations

from typing import Any

from train.compiling.warmup import plan_all_shapes, warm_up_for_run
from train.data import prepare_data
from train.errors import UserError
from train.setup import build_run, start_run


def run_warmup(cfg: Any, buckets_force: bool = False) -> dict[str, Any]:
    """``python -m train warmup``: build the run's model and bucket plan, warm every shape, write
    ``runs/<id>/warmup.json``.

    Compiles when ``compile.enabled`` resolves on (``make warmup`` passes ``compile.enabled=true``);
    otherwise warms the eager shapes and says why. Raises UserError for bad input.
    """
    start = start_run(cfg)
    run_dir = start.run_dir
    bundle = prepare_data(cfg, run_dir, buckets_force)
    run = build_run(cfg, bundle, start.device, start.policy, splits=("train", "validation", "test"), compile=True)
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

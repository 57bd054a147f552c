"""``python -m train optimize-grid``: the exhaustive grid that ``make optimize``'s search is judged against — every
combination of the search's crossable levers (grid_space.py: each lever's grid values are declared in levers.py),
measured with the search's own pieces: the same arms (:class:`~train.optimize.arms.ArmSet`), warmed and
interleaved the same way, the same quality guard after the same samples, each combination on the config's schedule
in samples as the search's candidates are (``optimize.lr_scaling``). Two stages, successive halving: the screening
(grid_screen.py) and the final with its re-check, each A/B in a new process (grid_final.py). ``--optimized
runs/<id>/optimize/optimized.yaml`` adds the search's result as one more arm, so its ratio to the grid's best is
paired and has an interval, and compares the search's time with the grid's.

Writes ``runs/<id>/optimize-grid/grid.{json,md}`` (grid_report.py). docs/optimize.md, "The exhaustive grid", says why
each stage is built as it is.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from train.compat import fused_adamw_supported
from train.config import RunConfig, load_config
from train.data import prepare_data
from train.errors import UserError, atomic_write_text
from train.optimize.arms import ArmSet
from train.optimize.backend import RunBackend
from train.optimize.command import baseline_settings
from train.optimize.grid_final import run_final
from train.optimize.grid_report import grid_json, render
from train.optimize.grid_screen import pick_finalists, screen
from train.optimize.grid_space import grid_points, name_of
from train.optimize.levers import SETTINGS_KEYS
from train.optimize.settings import SearchSettings
from train.precision import cpu_native_bf16
from train.setup import RunStart, start_run
from train.tools.env import device_name, machine_facts
from train.tools.progress import progress_bar


def grid_arms(start: RunStart, backend: Any, optimized: Optional[RunConfig]) -> dict[str, dict[str, Any]]:
    """The grid's arms by name: every combination (:func:`~train.optimize.grid_space.grid_points` on this
    device and model) with the schedule it needs; ``baseline``, the config as given (the quality reference of a
    combination that grows from none); and ``optimized``, the settings of the search's result, when given."""
    points = grid_points(start.cfg, cpu_native_bf16(), backend.context({}).supports_packing,
                         fused_adamw_supported(start.device), start.device.type == "cuda", workers=0)
    named = {name_of(p): {**p, **backend.schedule(p)} for p in points}
    named["baseline"] = baseline_settings(start.cfg, start.policy.mode)[0]
    if optimized is not None:
        # an auto the search left unmeasured runs as its baseline ran it
        named["optimized"] = {**{k: optimized.value(k) for k in SETTINGS_KEYS},
                              **baseline_settings(optimized, start.policy.mode)[0]}
    return named


def progress_total(o: Any, arms: int, points: int, paired: bool) -> int:
    """The progress bar's units: each arm's warm-up, screening rounds and quality read; the final's timed windows
    (``paired``: two arms per finalist); the re-check's."""
    final = min(o.grid_finalists, points) * (2 if paired else 1) * o.confirm_rounds
    return arms * (2 + o.grid_rounds) + final + (2 * o.recheck_rounds if paired else 0)


def run_grid(cfg: RunConfig, optimized: Optional[str] = None, notice: Callable[[str], None] = print,
             config_path: Optional[str] = None) -> dict[str, Any]:
    """Measure the grid (module docstring); returns grid.json's dict.

    Raises:
        UserError: an unreadable ``optimized`` config, no finalist measured, bad data or config.
    """
    extra = load_config(optimized) if optimized else None
    start = start_run(cfg, prefix="optimize-grid-")
    out_dir = start.run_dir / "optimize-grid"
    bundle = prepare_data(start.cfg, None, notice=notice)
    backend = RunBackend(start.cfg, bundle, start.device, out_dir, notice)
    named = grid_arms(start, backend, extra)
    o = start.cfg.optimize
    s = SearchSettings.from_config(o, backend.planned_samples())
    points = len(named) - 1 - (extra is not None)
    t0 = time.perf_counter()
    with progress_bar(progress_total(o, len(named), points, extra is not None), "optimize-grid",
                      cfg.train.progress) as bar:
        with ArmSet(backend, start.device) as arms:  # nothing of the screening stays alive for the final
            sc = screen(arms, named, o.grid_rounds, o.window_samples, s.quality_samples_seen(), backend, bar)
            judged = pick_finalists(arms, named, sc, s, o.grid_finalists, start.cfg.train.max_steps, notice)
        fin = run_final(start.run_dir / "config.yaml", backend, named, judged.finalists, o, out_dir / "final",
                        sc.rates, bar, notice)
    facts = {"device": device_name(start.device), "machine": machine_facts(start.device),
             "torch": torch.__version__, "config": config_path}
    seconds = time.perf_counter() - t0
    out = grid_json(named, sc, judged, fin, o, s, seconds, optimized if extra is not None else None, facts)
    atomic_write_text(out_dir / "grid.json", json.dumps(out, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "grid.md", render(out))
    out["out_dir"] = str(out_dir)
    return out


def check_optimized(path: Optional[str]) -> None:
    """Raises UserError when ``--optimized`` names no readable file."""
    if path and not os.path.isfile(path):
        raise UserError(f"--optimized {path}: no such file; pass runs/<id>/optimize/optimized.yaml from make optimize")

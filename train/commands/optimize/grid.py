"""``python -m train optimize-grid``: the exhaustive grid that ``make optimize``'s search is judged against — every
combination of the search's levers that can be crossed in one process (precision × batching × token budget × fast
dropout × fused AdamW), measured with the same A/B primitive: all combinations interleaved,
``optimize.grid_rounds`` rounds of ``optimize.window_samples`` samples each.
``--optimized runs/<id>/optimize/optimized.yaml`` adds the search's result as one more arm, so its ratio to the
grid's best is paired and has an interval.

Writes ``runs/<id>/optimize-grid/grid.{json,md}``. Levers that cannot be crossed in one process interleaved with the
others (DataLoader workers: a process pool per arm; CPU threads: process-wide; compilation: minutes per arm on a
CPU)
are left out and listed.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any, Optional

from train.config import RunConfig, load_config
from train.errors import UserError, atomic_write_text

LEFT_OUT = {"workers": "a DataLoader process pool per arm: forked from a process holding every arm, each worker "
                       "grew to ~7 GB and the 24 GiB machine ran out of memory (measured); the search A/Bs it alone",
            "threads": "torch's thread count is process-wide (and every core is in use by default)",
            "compile": "one compilation per arm and shape (minutes on a CPU)",
            "allocator": "process-wide, CUDA only"}


def grid_points(base: RunConfig, native_bf16: bool, supports_packing: bool, fused: bool, cuda: bool = False,
                workers: int = 0) -> list[dict[str, Any]]:
    """Every combination of the crossable levers' values, as overrides on ``base`` (``workers`` > 0: DataLoader
    workers crossed too, 0 and that many — a process pool per arm: mind the memory)."""
    precisions = ["fp32"] + (["bf16"] if native_bf16 or cuda else []) + (["fp16"] if cuda else [])
    budget0 = base.batching.batch_size * base.data.max_len
    batching: list[dict[str, Any]] = [{"batching.method": "pad-to-max", "batching.max_tokens": None},
                                      {"batching.method": "hf-group-by-length", "batching.max_tokens": None}]
    for method in ["optimal"] + (["packed"] if supports_packing else []):
        for budget in (None, budget0, 2 * budget0):
            batching.append({"batching.method": method, "batching.max_tokens": budget})
    out = []
    for p, b, drop, fz, nw in itertools.product(precisions, batching, ("false", "true"),
                                                (False, True) if fused else (False,),
                                                (0, workers) if workers else (0,)):
        out.append({"train.precision": p, **b, "model.fast_dropout": drop, "optim.fused": fz, "data.num_workers": nw})
    return out


def name_of(point: dict[str, Any]) -> str:
    b = point["batching.max_tokens"]
    return (f"{point['train.precision']}/{point['batching.method']}/{'batch' if b is None else b}/"
            f"drop-{'fast' if point['model.fast_dropout'] == 'true' else 'nn'}/"
            f"{'fused' if point['optim.fused'] else 'adamw'}/w{point['data.num_workers']}")


def run_grid(cfg: RunConfig, optimized: Optional[str] = None, notice: Callable[[str], None] = print,
             config_path: Optional[str] = None) -> dict[str, Any]:
    """Measure the grid (module docstring); returns grid.json's dict.

    Raises:
        UserError: an unreadable ``optimized`` config, bad data or config.
    """
    import torch

    from train.commands.optimize.backend import RunBackend
    from train.compat import fused_adamw_supported
    from train.data import prepare_data
    from train.perf.ab import Arm, interleave
    from train.precision import cpu_native_bf16
    from train.setup import start_run
    from train.tools.env import device_name, machine_facts
    from train.tools.progress import progress_bar

    extra = load_config(optimized) if optimized else None
    start = start_run(cfg, prefix="optimize-grid-")
    out_dir = start.run_dir / "optimize-grid"
    bundle = prepare_data(start.cfg, None, notice=notice)
    backend = RunBackend(start.cfg, bundle, start.device, out_dir, notice)
    ctx = backend.context({})
    points = grid_points(start.cfg, cpu_native_bf16(), ctx.supports_packing, fused_adamw_supported(start.device),
                         start.device.type == "cuda", workers=0)
    named = {name_of(p): p for p in points}
    if extra is not None:
        keys = ("train.precision", "batching.method", "batching.max_tokens", "model.fast_dropout", "optim.fused",
                "data.num_workers", "train.num_threads", "compile.enabled", "compile.mode")
        named["optimized"] = {k: getattr(getattr(extra, k.split(".")[0]), k.split(".")[1]) for k in keys}
    t0 = time.perf_counter()
    o = start.cfg.optimize
    arms, handles = [], []
    with progress_bar(len(named) * (1 + o.grid_rounds), "optimize-grid", cfg.train.progress) as bar:
        for name, point in named.items():
            h = backend.arm(name, point)
            h.warmup(o.window_samples)
            handles.append(h)
            arms.append(Arm(name, h.step))
            bar.update(1)
        result = interleave(arms, rounds=o.grid_rounds, window_samples=o.window_samples, warmup=0,
                            device=start.device, on_round=lambda _r: bar.update(len(arms)))
    seconds = time.perf_counter() - t0
    medians = {n: result.arms[n].median("samples") for n in named}
    ranked = sorted((n for n in named if n != "optimized"), key=lambda n: -(medians[n] or 0))
    best = ranked[0]
    rows = [{"name": n, "settings": named[n], "samples_per_s": medians[n],
             "vs_best": result.ratio(n, best).as_dict() if n != best else None} for n in ranked]
    out: dict[str, Any] = {
        "best": best, "best_samples_per_s": medians[best], "points": len(ranked), "seconds": seconds,
        "rounds": o.grid_rounds, "window_samples": o.window_samples, "rows": rows, "left_out": LEFT_OUT,
        "device": device_name(start.device), "load_1min": [result.load_start, result.load_end],
        "machine": machine_facts(start.device), "torch": torch.__version__, "config": config_path,
        "optimized": None if extra is None else {"config": optimized, "settings": named["optimized"],
                                                 "samples_per_s": medians["optimized"],
                                                 "vs_best": result.ratio("optimized", best).as_dict()},
    }
    atomic_write_text(out_dir / "grid.json", json.dumps(out, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "grid.md", render(out))
    out["out_dir"] = str(out_dir)
    return out


def render(g: dict[str, Any]) -> str:
    lines = [f"# optimize-grid: {g['points']} combinations in {g['seconds']:.0f} s ({g['device']}, load "
             f"{g['load_1min']})", "", f"Best: **{g['best']}** at {g['best_samples_per_s']:.1f} samples/s.", ""]
    if g["optimized"]:
        r = g["optimized"]["vs_best"]
        lines += [f"`make optimize`'s result ({g['optimized']['config']}): {g['optimized']['samples_per_s']:.1f} "
                  f"samples/s = {r['median']:.3f}x [{r['low']:.3f}, {r['high']:.3f}] of the grid's best "
                  f"({r['verdict']}).", ""]
    lines += ["| combination | samples/s | vs best [95% interval] |", "|---|---|---|"]
    for row in g["rows"]:
        r = row["vs_best"]
        lines.append(f"| {row['name']} | {row['samples_per_s']:.1f} | "
                     + ("best" if r is None else f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]") + " |")
    lines += ["", "Left out of the grid: " + "; ".join(f"{k} ({v})" for k, v in g["left_out"].items()), ""]
    return "\n".join(lines)


def check_optimized(path: Optional[str]) -> None:
    """Raises UserError when ``--optimized`` names no readable file."""
    import os

    if path and not os.path.isfile(path):
        raise UserError(f"--optimized {path}: no such file; pass runs/<id>/optimize/optimized.yaml from make optimize")

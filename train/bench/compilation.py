"""``python -m train bench-compile``: what torch.compile costs and gives, measured side by side.

1. Three separate processes run the same first training step (same data, seed, first batch):
   eager; compiled with an empty compile cache (cold); compiled with the cache the previous process
   filled (warm). Each reports ``time_to_first_step_s`` from its own start (before ``import torch``)
   and ``first_step_s`` (the step alone: compilation included).
2. In this process: steady-state step time, eager vs compiled, on real batches of the first batch's
   shape, interleaved in rounds after both were warmed up, with synchronisation; medians and ratios.
   Compiled steps after warm-up are checked for recompiles; a hit recompile limit voids the compiled figure.

Writes ``runs/<id>/bench-compile.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from train import compat
from train.compiling.session import CompileSession
from train.errors import UserError, atomic_write_text
from train.perf.ab import Arm, interleave
from train.perf.timer import Timed, percentiles
from train.tools.progress import beside, progress_bar

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (holds the ``train`` package): the children's PYTHONPATH. Not ``train/commands``, whose
``profile.py`` would shadow the standard library's ``profile`` that ``torch._dynamo`` imports through ``cProfile``."""


def _setup(cfg: Any) -> tuple:
    """The run's start, data and :func:`~train.setup.build_run` (training loader only); ``(run, data seconds)``."""
    from train.data import prepare_data
    from train.setup import build_run, start_run

    start = start_run(cfg, run_dir=False)
    t0 = time.perf_counter()
    bundle = prepare_data(cfg, None, notice=lambda _msg: None)
    data_s = time.perf_counter() - t0
    return build_run(cfg, bundle, start.device, start.policy), data_s


def first_step_child(cfg: Any, t_start: float, out: str) -> None:
    """One process: set up like a run, do exactly one training step on the first batch, write timings to ``out``."""
    run, data_s = _setup(cfg)
    device, bundle = run.device, run.bundle
    session = CompileSession.create(cfg.compile, device, run.model, bundle.pad_to)
    run.trainer.train_model = session.forward
    with Timed(device) as t:
        rec = run.trainer.step()
    t0, t1 = t.start, t.end
    result = {"time_to_first_step_s": t1 - t_start, "first_step_s": t1 - t0, "setup_s": t0 - t_start,
              "data_prep_s": data_s, "shape": [rec.rows, rec.seq_len], "compile_enabled": session.enabled,
              "compile_reason": session.reason, "cache_dir": session.cache.dir if session.cache else None,
              "cache_state": session.cache.state if session.cache else None,
              "cache_counts": compat.compile_cache_counts() if session.enabled else None,
              "graphs_compiled": compat.compiled_graph_count()}
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")


def _child(config: Optional[str], overrides: list[str], extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "train", "bench-compile", *(["--config", config] if config else []), *overrides,
           "train.progress=false", *extra, "--child", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"bench-compile child failed ({' '.join(extra)}), exit {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["process_wall_s"] = wall
    return result


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def steady_compare(cfg: Any) -> dict[str, Any]:
    """Eager vs compiled training steps (:meth:`~train.trainer.Trainer.step`, one model, a trainer each) on real
    batches of the first batch's shape, after warm-up of both, through the one A/B primitive
    (``bench_compile.rounds`` rotated rounds of ``bench_compile.steps`` steps each)."""
    from train.compiling.warmup import planned_shapes, warm_up
    from train.setup import build_run

    steps, rounds = cfg.bench_compile.steps, cfg.bench_compile.rounds
    run, _ = _setup(cfg)
    device, model, loader = run.device, run.model, run.loaders["train"]
    session = CompileSession.create(cfg.compile, device, model, run.bundle.pad_to)
    if not session.enabled:
        raise UserError(f"bench-compile needs compile on: {session.reason}")
    eager = run.trainer
    compiled = build_run(cfg, run.bundle, device, run.policy, model=model).trainer
    compiled.train_model = session.forward
    first = next(iter(loader))
    key = ("train", *first["input_ids"].shape)
    shape = planned_shapes(loader, "train", per_shape=steps)[key]
    c = cfg.compile
    warm = {name: warm_up(tr, model, fwd, {key: shape}, c.warmup_cv, c.warmup_window, c.warmup_max_steps,
                          notice=lambda _m: None)
            for name, tr, fwd in (("eager", eager, model), ("compiled", compiled, session.forward))}
    session.monitor.end_warmup()

    def arm(name: str, trainer: Any) -> Arm:
        calls = itertools.count()

        def one() -> None:
            trainer.step(shape.batches[next(calls) % len(shape.batches)], count=False)

        return Arm(name, one)

    with progress_bar(rounds, "bench-compile steady", cfg.train.progress, unit="round") as bar:
        ab = interleave([arm("eager", eager), arm("compiled", compiled)], rounds=rounds, window=steps, warmup=0,
                        device=device, on_round=lambda _r: bar.update(1))
    m = session.monitor
    limit_hit = m.limit_hit or bool(m.eager_fallback_shapes)
    per_step = {name: [1e3 * w.seconds / w.steps for w in ab.arms[name].windows] for name in ("eager", "compiled")}
    eager_p, comp_p = percentiles(per_step["eager"]), percentiles(per_step["compiled"])
    out = {"shape": list(key[1:]), "steps_per_round": steps, "rounds": rounds, "eager_step_ms": eager_p,
           "compiled_step_ms": comp_p, "eager_step_ms_p50": eager_p["p50"],
           "compiled_step_ms_p50": None if limit_hit else comp_p["p50"],
           "recompiles_after_warmup": m.graphs_after_warmup, "recompile_events": m.events[:5],
           "recompile_limit_hit": limit_hit, "speedup": ab.ratio("compiled", "eager", "steps").as_dict(),
           "load_1min_start": ab.load_start, "load_1min_end": ab.load_end,
           "warmup": {name: w["shapes"][0] for name, w in warm.items()}}
    if limit_hit:
        out["compiled_step_ms_p50_unavailable_reason"] = "recompile limit hit: the 'compiled' steps ran eagerly"
        out["speedup"] = None
    out["speedup_eager_over_compiled_p50"] = _ratio(out["eager_step_ms_p50"], out["compiled_step_ms_p50"])
    return out


def run_compile_bench(cfg: Any, config: Optional[str], overrides: list[str]) -> dict[str, Any]:
    """The whole benchmark with the ``bench_compile`` settings; returns and writes ``runs/<id>/bench-compile.json``.
    ``config`` and ``overrides`` are the command line's, passed on to the three first-step processes."""
    from train.tools.env import collect_env, resolve_device
    from train.tools.run_dir import make_run_dir

    run_dir = make_run_dir(cfg, prefix="bench-compile-")
    cache = (run_dir / "inductor-cache").resolve()
    shutil.rmtree(cache, ignore_errors=True)  # cold by construction
    base = [o for o in overrides if not o.startswith(("compile.enabled=", "compile.cache_dir=", "train.run_id="))]
    print(f"bench-compile: 3 processes (eager, compiled cold, compiled warm); cache {cache}", flush=True)
    compiled_args = ["compile.enabled=true", f"compile.cache_dir={cache}"]
    firsts: dict[str, dict] = {}
    with progress_bar(3, "bench-compile first steps", cfg.train.progress, unit="process") as bar:
        say = beside(bar, lambda m: print(m, flush=True))
        for name, label, extra in (("eager", "eager", ["compile.enabled=false"]),
                                   ("cold", "compiled, cold cache", compiled_args),
                                   ("warm", "compiled, warm cache", compiled_args)):
            firsts[name] = _child(config, base, extra, run_dir / f"child-{name}.json")
            bar.update(1)
            say(f"  {label}: first step after {firsts[name]['time_to_first_step_s']:.1f}s")
    eager, cold, warm = firsts["eager"], firsts["cold"], firsts["warm"]
    no_disk_cache = cfg.compile.backend != "inductor"  # eager/aot_eager trace only: nothing is written to the cache
    if not no_disk_cache and (cold["cache_state"] != "cold" or warm["cache_state"] != "warm"):
        raise RuntimeError(f"cache states were {cold['cache_state']}/{warm['cache_state']}, expected cold/warm")

    steady = steady_compare(cfg.with_values({"compile.enabled": "true", "compile.cache_dir": str(cache)}))
    ratio_warm_cold = _ratio(warm["time_to_first_step_s"], cold["time_to_first_step_s"])
    result = {
        "cold_time_to_first_step_s": cold["time_to_first_step_s"],
        "warm_time_to_first_step_s": warm["time_to_first_step_s"],
        "eager_time_to_first_step_s": eager["time_to_first_step_s"],
        "warm_over_cold_time_to_first_step": ratio_warm_cold,
        "cold_first_step_s": cold["first_step_s"], "warm_first_step_s": warm["first_step_s"],
        "eager_first_step_s": eager["first_step_s"],
        "warm_over_cold_first_step": _ratio(warm["first_step_s"], cold["first_step_s"]),
        "recompiles_after_warmup": steady["recompiles_after_warmup"],
        "compiled_step_ms_p50": steady["compiled_step_ms_p50"],
        "eager_step_ms_p50": steady["eager_step_ms_p50"],
        "compiled_over_eager_step_ms_p50": _ratio(steady["compiled_step_ms_p50"], steady["eager_step_ms_p50"]),
        "speedup_eager_over_compiled_p50": steady["speedup_eager_over_compiled_p50"],
        "targets": {"warm_time_to_first_step_le_25pct_of_cold": {
            "value": ratio_warm_cold, "target": 0.25,
            "reached": ratio_warm_cold is not None and ratio_warm_cold <= 0.25}},
        "processes": {"eager": eager, "cold": cold, "warm": warm},
        "steady": steady,
        "cache_dir": str(cache),
        **({"cache_comparison_note": f"compile.backend={cfg.compile.backend} keeps no on-disk cache: "
                                      "'warm' is a second cold process"} if no_disk_cache else {}),
        "config": config, "overrides": overrides,
        "env": {**collect_env(resolve_device(cfg.train.device)), "num_threads": torch.get_num_threads()},
        "note": ("time_to_first_step_s is from process start (before import torch) to the end of the first optimizer "
                 "step: imports, data, tokenizer (cached), model, compilation. Ratios are from one invocation; on a "
                 "machine shared with other work wall-clock numbers are noisy."),
    }
    atomic_write_text(run_dir / "bench-compile.json", json.dumps(result, indent=2) + "\n")
    print(f"cold {result['cold_time_to_first_step_s']:.1f}s, warm {result['warm_time_to_first_step_s']:.1f}s "
          f"(warm/cold {ratio_warm_cold:.2f}); step p50 eager {steady['eager_step_ms_p50']:.1f} ms, compiled "
          f"{'n/a' if steady['compiled_step_ms_p50'] is None else format(steady['compiled_step_ms_p50'], '.1f')} ms; "
          f"recompiles after warm-up {steady['recompiles_after_warmup']}; wrote {run_dir / 'bench-compile.json'}",
          flush=True)
    return result

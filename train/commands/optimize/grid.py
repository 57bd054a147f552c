"""``python -m train optimize-grid``: the exhaustive grid that ``make optimize``'s search is judged against — every
combination of the search's levers that can be crossed in one process (precision × batching — pad-to-max,
hf-group-by-length, fitted buckets padded to their bounds or to the batch maximum, packing — × token budget × fast
dropout × fused AdamW), measured with the same A/B primitive: all combinations interleaved,
``optimize.grid_rounds`` rounds of ``optimize.window_samples`` samples each (the screening), then the
``optimize.grid_finalists`` fastest combinations re-measured over ``optimize.confirm_rounds`` interleaved rounds (the
final: successive halving, as in Jamieson & Talwalkar 2016, so the best is picked, and its ratios measured, from
enough paired rounds rather than from 3 windows among a hundred arms) — with ``--optimized``, each finalist against
the search's result alone, two arms interleaved as in the search's A/Bs (measured: with five arms interleaved,
packed rows of 4096 tokens read 1.20x the search's result; alone against it 0.92x [0.75, 0.99], and 0.98x in whole
``make train`` runs). Each of the final's A/Bs runs in a new process (:mod:`~train.commands.optimize.isolated`):
arms timed in the screening's process, even built afresh after its hundred arms were closed, did not run at their
own speed (the search's result at 276 samples/s there, 394.7 in a whole run right after; packed rows of 4096
tokens 1.41x [1.38, 1.46] it there, 0.89x in whole runs). The best so picked is the largest of several noisy
ratios (the winner's curse), so it is measured once more against the search's result after the pick, in one more new
process (the re-check), and the search is judged on that A/B (:func:`~train.commands.optimize.grid_report.
optimized_vs_best`).
Every combination then passes the search's quality guard or is no finalist (:func:`quality_guard`): each arm trains
untimed up to the samples the search takes its verdicts after (``(1 + optimize.rounds) × optimize.window_samples``),
and its held-out loss must lie within ``optimize.quality_tolerance`` of its reference's — the config as given (one
more arm, ``baseline``), or, with a token budget, the same combination at the config's batch size — with no
non-finite step: the grid's best must learn as well, as the search's result must. Combinations run on the config's
schedule in samples, as the search's candidates do (``optimize.lr_scaling``).
``--optimized runs/<id>/optimize/optimized.yaml`` adds the search's result as one more arm of both stages, so its
ratio to the grid's best is paired and has an interval; the search's own time (its ``optimize.json`` beside the
yaml) is compared with the grid's.

Writes ``runs/<id>/optimize-grid/grid.{json,md}``. Levers that cannot be crossed in one process interleaved with the
others (DataLoader workers: a process pool per arm; CPU threads: process-wide; compilation: minutes per arm on a
CPU)
are left out and listed.
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from collections.abc import Callable
from typing import Any, Optional

from train.commands.optimize.grid_report import _loss, optimized_vs_best, render
from train.config import RunConfig, load_config
from train.errors import UserError, atomic_write_text

LEFT_OUT = {"workers": "a DataLoader process pool per arm: forked from a process holding every arm, each worker "
                       "grew to ~7 GB and the 24 GiB machine ran out of memory (measured); the search A/Bs it alone",
            "threads": "torch's thread count is process-wide (and every core is in use by default)",
            "compile": "one compilation per arm and shape (minutes on a CPU)",
            "allocator": "process-wide, CUDA only"}


FINAL_WINDOW_STEPS = 16
"""The final's and the re-check's timed windows hold at least this many optimizer steps of the pair's arm with the
most samples per step (``optimize.window_samples`` at the least): a window of a few steps times whichever buckets
came up. Measured (grid-naive-9): with 384-sample windows — about 3 steps of a 4096-token budget in fitted buckets —
the re-check's per-round ratios ran from 0.70 to 1.26 and its interval was [0.818, 1.047]."""


def grid_points(base: RunConfig, native_bf16: bool, supports_packing: bool, fused: bool, cuda: bool = False,
                workers: int = 0) -> list[dict[str, Any]]:
    """Every combination of the crossable levers' values, as overrides on ``base`` (``workers`` > 0: DataLoader
    workers crossed too, 0 and that many — a process pool per arm: mind the memory)."""
    precisions = ["fp32"] + (["bf16"] if native_bf16 or cuda else []) + (["fp16"] if cuda else [])
    budget0 = base.batching.batch_size * base.data.max_len
    batching: list[dict[str, Any]] = [
        {"batching.method": "pad-to-max", "batching.pad_to": "bound", "batching.max_tokens": None},
        {"batching.method": "hf-group-by-length", "batching.pad_to": "bound", "batching.max_tokens": None}]
    for method, pad_to in [("optimal", "bound"), ("optimal", "batch-max")] + (
            [("packed", "bound")] if supports_packing else []):
        for budget in (None, budget0 // 2, budget0, 2 * budget0):  # the token-budget lever's values (budget_ladder)
            batching.append({"batching.method": method, "batching.pad_to": pad_to, "batching.max_tokens": budget})
    out = []
    for p, b, drop, fz, nw in itertools.product(precisions, batching, ("false", "true"),
                                                (False, True) if fused else (False,),
                                                (0, workers) if workers else (0,)):
        out.append({"train.precision": p, **b, "model.fast_dropout": drop, "optim.fused": fz, "data.num_workers": nw})
    return out


def twin_of(named: dict[str, dict[str, Any]], name: str) -> Optional[str]:
    """The combination ``name`` is grown from, as the search would try it: with a token budget, the same at the
    config's batch size; packed rows (no budget), the same in fitted buckets; None for any other (or a twin the grid
    does not hold: the reference is then the config as given)."""
    point = named[name]
    if name == "baseline" or "train.precision" not in point:
        return None
    if point.get("batching.max_tokens") is not None:
        twin = {**point, "batching.max_tokens": None}
    elif point.get("batching.method") == "packed":
        twin = {**point, "batching.method": "optimal", "batching.pad_to": "bound"}
    else:
        return None
    n = name_of(twin)
    return n if n in named and n != name else None


def quality_guard(named: dict[str, dict[str, Any]], quality: dict[str, dict], tolerance: float,
                  at_horizon: Optional[Callable[[str], dict]] = None, names: Optional[list[str]] = None,
                  base_steps: Optional[int] = None) -> dict[str, dict]:
    """Each arm's quality verdict ``{passes, why}`` by the search's rule (:func:`~train.commands.optimize.judging.
    quality_verdict`, every arm after the same samples), against the reference the search would have held it to:
    its :func:`twin_of` — which must itself pass — else the config as given (``baseline``). An arm whose optimizer
    steps per sample differ from its reference's (``train.max_steps``, ``base_steps`` where unset) is judged, with
    its reference, on ``at_horizon(name)`` — the quality after ``optimize.horizon_fraction`` of the planned run —
    when given, as the search judges such a lever. ``names``: the arms to judge (default: every arm in ``quality``;
    the references they need are judged too)."""
    from train.commands.optimize.judging import quality_verdict

    done: dict[str, dict[str, Any]] = {}

    def verdict(name: str) -> dict[str, Any]:
        if name in done:
            return done[name]
        twin = twin_of(named, name)
        ref, words = (twin, f"{twin} (the combination it grows from)") if twin else ("baseline",
                                                                                      "the config as given")
        if twin:
            first = verdict(twin)
            if not first["passes"]:
                done[name] = {"passes": False, "why": f"grown from {twin}, which learns worse: {first['why']}"}
                return done[name]
        steps = [named[n].get("train.max_steps", base_steps) for n in (name, ref)]
        late = at_horizon is not None and name != "baseline" and steps[0] != steps[1]
        q_ref, q = (at_horizon(ref), at_horizon(name)) if late else (quality[ref], quality[name])
        ok, why = quality_verdict(q_ref, q, tolerance, words)
        if late:
            why += f" (at {q.get('samples_seen')} samples: other steps per sample, judged late in the run)"
        done[name] = {"passes": ok, "why": why}
        return done[name]

    return {n: verdict(n) for n in (names if names is not None else list(quality))}


def name_of(point: dict[str, Any]) -> str:
    b = point["batching.max_tokens"]
    method = point["batching.method"] + ("+batch-max" if point.get("batching.pad_to") == "batch-max" else "")
    return (f"{point['train.precision']}/{method}/{'batch' if b is None else b}/"
            f"drop-{'fast' if point['model.fast_dropout'] == 'true' else 'nn'}/"
            f"{'fused' if point['optim.fused'] else 'adamw'}/w{point['data.num_workers']}")


def run_grid(cfg: RunConfig, optimized: Optional[str] = None, notice: Callable[[str], None] = print,
             config_path: Optional[str] = None) -> dict[str, Any]:
    """Measure the grid (module docstring); returns grid.json's dict.

    Raises:
        UserError: an unreadable ``optimized`` config, bad data or config.
    """
    import torch

    from train.commands.optimize import baseline_settings, isolated
    from train.commands.optimize.backend import RunBackend
    from train.commands.optimize.judging import throughput_metric
    from train.commands.optimize.levers import SCHEDULE_KEYS
    from train.commands.optimize.pairs import counting, window_for
    from train.commands.optimize.search import SearchSettings
    from train.compat import fused_adamw_supported
    from train.data import prepare_data
    from train.perf.ab import Arm, ArmResult, interleave
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
    # each combination on the config's schedule in samples, as the search's candidates are (optimize.lr_scaling)
    named: dict[str, dict[str, Any]] = {name_of(p): {**p, **backend.schedule(p)} for p in points}
    named["baseline"] = baseline_settings(start.cfg, start.policy.mode)[0]
    if extra is not None:
        keys = ("train.precision", "batching.method", "batching.pad_to", "batching.max_tokens", "model.fast_dropout",
                "optim.fused", "data.num_workers", "train.num_threads", "compile.enabled", "compile.mode",
                *SCHEDULE_KEYS)
        named["optimized"] = {k: extra.value(k) for k in keys}
    t0 = time.perf_counter()
    o = start.cfg.optimize
    arms: dict[str, Arm] = {}
    handles: dict[str, Any] = {}
    n_final = min(o.grid_finalists, len(points)) * (2 if extra is not None else 1)  # arms timed in the final
    total = len(named) * (2 + o.grid_rounds) + n_final * o.confirm_rounds
    total += 2 * o.recheck_rounds if extra is not None else 0  # the re-check of the best against the search's result
    seen = dict.fromkeys(named, o.window_samples)  # each arm's training samples (the warm-up: at least a window)

    quality_after = SearchSettings.from_config(o).quality_samples_seen()
    with progress_bar(total, "optimize-grid", cfg.train.progress) as bar:
        for name, point in named.items():
            handles[name] = h = backend.arm(name, point)
            h.warmup(o.window_samples)
            arms[name] = Arm(name, counting(h.step, seen, name))
            bar.update(1)
        screen = interleave(list(arms.values()), rounds=o.grid_rounds, window_samples=o.window_samples, warmup=0,
                            device=start.device, on_round=lambda _r: bar.update(len(arms)))
        quality = {}
        for name, h in handles.items():  # untimed steps up to the samples the search's verdicts are taken after
            while seen[name] < quality_after:
                arms[name].step()
            quality[name] = h.quality()
            bar.update(1)
        horizon = SearchSettings.from_config(o, backend.planned_samples()).horizon_samples
        late: dict[str, dict] = {}

        def at_horizon(name: str) -> dict:  # trained on, untimed, to the search's horizon (on demand, once)
            if name not in late:
                t = time.perf_counter()
                while seen[name] < horizon:
                    arms[name].step()
                late[name] = handles[name].quality()
                notice(f"optimize-grid: {name} trained on to {seen[name]} samples for its quality verdict "
                       f"({time.perf_counter() - t:.0f} s): held-out loss {_loss(late[name].get('loss'))}")
            return late[name]

        def judge(names: list[str]) -> dict[str, dict]:
            return quality_guard(named, quality, o.quality_tolerance, at_horizon if horizon else None, names,
                                 start.cfg.train.max_steps)

        screen_s = time.perf_counter() - t0
        metric = throughput_metric(screen)  # real tokens per second, reported as samples per second (÷ per sample)
        per_sample = backend.real_tokens_per_sample() if metric == "real_tokens" else 1.0

        def rate(result: Any, name: str) -> Optional[float]:
            m = result.arms[name].median(metric)
            return None if m is None else m / per_sample

        medians = {n: rate(screen, n) for n in named}
        ranked = sorted((n for n in named if n not in ("optimized", "baseline")), key=lambda n: -(medians[n] or 0))
        t_guard = time.perf_counter()
        guard = judge(["baseline"] + (["optimized"] if extra is not None else []))
        learn_as_well: list[str] = []
        for n in ranked:  # judged in the screening's order until enough learn as well (a late verdict trains on)
            guard.update(judge([n]))
            if guard[n]["passes"]:
                learn_as_well.append(n)
            if len(learn_as_well) == o.grid_finalists:
                break
        for n in ranked:
            guard.setdefault(n, {"passes": None, "why": "not judged: below the finalists in the screening"})
        finalists = (learn_as_well or ranked)[:o.grid_finalists]
        guard_s = time.perf_counter() - t_guard
        for h in handles.values():  # nothing of the screening stays alive while the final runs
            h.close()
        handles.clear()
        arms.clear()
        gc.collect()
        failed: dict[str, str] = {}

        def window(group: list[str]) -> int:  # FINAL_WINDOW_STEPS steps of the arm with the most samples per step
            return window_for(backend, [named[n] for n in group], o.window_samples, FINAL_WINDOW_STEPS)

        def fresh(group: list[str], work: str, rounds: int) -> Any:
            """An A/B of ``group`` over ``rounds`` in a new process (isolated.py: this one holds the screening's
            heap), in ``final/<work>``; raises IsolatedFailure."""
            return isolated.measure_in_fresh_process(
                start.run_dir / "config.yaml", {n: named[n] for n in group}, rounds=rounds,
                window_samples=window(group), warmup_samples=o.window_samples, work_dir=out_dir / "final" / work,
                timeout_s=o.arm_timeout_s)

        def measure(group: list[str], index: int) -> Optional[Any]:
            """The final's A/B of ``group`` (:func:`fresh`); a failure leaves its finalists not measured."""
            try:
                return fresh(group, str(index), o.confirm_rounds)
            except isolated.IsolatedFailure as e:
                failed.update({n: str(e) for n in group if n != "optimized"})
                notice(f"optimize-grid: the final of {', '.join(group)} failed: {e}")
                return None
            finally:
                bar.update(len(group) * o.confirm_rounds)

        if extra is None:  # the finalists against each other
            final = measure(finalists, 0)
            pairs = {n: final for n in finalists} if final is not None else {}
        else:  # the search's result against each finalist, two arms at a time: the search's own A/B
            pairs = {n: r for i, n in enumerate(finalists) if (r := measure(["optimized", n], i)) is not None}
        finalists = [n for n in finalists if n in pairs]
        if not finalists:
            raise UserError(f"optimize-grid: no finalist could be measured: {next(iter(failed.values()))}")
        final = pairs[finalists[0]]
        recheck, recheck_failed = None, None
        if extra is not None:  # the best is the largest of noisy ratios: its ratio is re-measured after the pick
            best = max(finalists, key=lambda n: pairs[n].ratio(n, "optimized", metric).median or 0)
            try:
                recheck = fresh(["optimized", best], "recheck", o.recheck_rounds)
            except isolated.IsolatedFailure as e:
                recheck_failed = str(e)
                notice(f"optimize-grid: the re-check of {best} failed: {e}")
            bar.update(2 * o.recheck_rounds)
    seconds = time.perf_counter() - t0
    final_medians = {n: rate(pairs[n], n) for n in finalists}
    if extra is None:
        best = max(finalists, key=lambda n: final_medians[n] or 0)
        vs = {n: final.ratio(n, best, metric).as_dict() if n != best else None for n in finalists}
    else:
        vs = {n: pairs[n].ratio(n, "optimized", metric).as_dict() for n in finalists}
        pooled = ArmResult("optimized", [w for n in finalists for w in pairs[n].arms["optimized"].windows])
        m = pooled.median(metric)  # over every pair's windows of the search's result
        final_medians["optimized"] = None if m is None else m / per_sample
    rows = [{"name": n, "settings": named[n], "samples_per_s": medians[n],
             "vs_best": screen.ratio(n, best, metric).as_dict() if n != best else None, "quality": quality[n],
             "quality_guard": guard[n]} for n in ranked + ["baseline"]]
    final_rows = [{"name": n, "samples_per_s": final_medians[n], "vs_best": vs[n] if extra is None else None,
                   "vs_optimized": vs[n] if extra is not None else None}
                  for n in sorted(finalists, key=lambda n: -(final_medians[n] or 0))]
    out: dict[str, Any] = {
        "best": best, "best_samples_per_s": final_medians[best], "points": len(ranked), "seconds": seconds,
        "fastest_of_the_screening": ranked[0], "quality_reference": {"settings": named["baseline"],
                                                                     **quality["baseline"]},
        "quality_tolerance": o.quality_tolerance, "quality_samples_seen": quality_after,
        "rejected_by_quality_guard": [n for n in ranked if guard[n]["passes"] is False],
        "quality_horizon_samples": horizon, "judged_at_the_horizon": sorted(late),
        "screening": {"rounds": o.grid_rounds, "seconds": screen_s, "rows": rows,
                      "load_1min": [screen.load_start, screen.load_end]},
        "guard_seconds": guard_s,
        "final": {"rounds": o.confirm_rounds, "seconds": seconds - screen_s - guard_s, "rows": final_rows,
                  "paired_with_optimized": extra is not None, "load_1min": [final.load_start, final.load_end],
                  "process": "fresh: one new process per A/B (isolated.py)", "failed": failed},
        "window_samples": o.window_samples, "metric": metric, "real_tokens_per_sample": per_sample,
        "left_out": LEFT_OUT,
        "device": device_name(start.device), "load_1min": [screen.load_start, final.load_end],
        "machine": machine_facts(start.device), "torch": torch.__version__, "config": config_path,
        "optimized": None if extra is None else {
            **optimized_vs_best(optimized, named["optimized"], pairs[best], best, final_medians["optimized"], seconds,
                                metric=metric, recheck=recheck, recheck_failed=recheck_failed),
            "quality": quality["optimized"], "quality_guard": guard["optimized"]},
    }
    atomic_write_text(out_dir / "grid.json", json.dumps(out, indent=2, default=str) + "\n")
    atomic_write_text(out_dir / "grid.md", render(out))
    out["out_dir"] = str(out_dir)
    return out


def check_optimized(path: Optional[str]) -> None:
    """Raises UserError when ``--optimized`` names no readable file."""
    import os

    if path and not os.path.isfile(path):
        raise UserError(f"--optimized {path}: no such file; pass runs/<id>/optimize/optimized.yaml from make optimize")

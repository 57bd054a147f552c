"""``python -m train bench-generate [RUN_DIR]``: a decoder answering requests, measured as a server sees it.

Per serving path that runs here (train/generate/engines.py, chosen and warmed by train/generate/serving.py):
**single** requests one after another (closed loop),
**batched** (every request at once: the maximum rate, closed loop) — a static-batching server on ``generate`` (batches
of ``generate.batch_size``, left-padded, one at a time) or continuous batching — then, on the chosen path and on the
static-batching server as the baseline, **open loop** at ``generate.load_levels`` of the chosen path's batched rate
(Poisson arrivals computed before the run; latency includes queueing). ``generate.path=auto`` keeps the path with the
highest batched output tokens/s, timed interleaved with the A/B primitive (paired ratios against ``dynamic``).
Greedy outputs are compared across paths token by token (fp32). Every TPOT is also given as a multiple of its floor,
the bytes a decode step reads over the measured memory bandwidth (train/generate/floor.py). Writes
``runs/<id>/generate.json`` and ``generate.png`` (latency CDF, throughput vs p99 TTFT).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from train.errors import UserError, atomic_write_text
from train.generate.decode_choices import choose_threads
from train.generate.engines import PATHS, greedy_config, serve
from train.generate.figures import RequestTiming, poisson_arrivals, summarize
from train.generate.serving import auto_path, available_paths, warm_single_batched


def _mismatches(runs: dict[str, list[RequestTiming]], reference: list[RequestTiming]) -> list[str]:
    out = []
    for name, timings in runs.items():
        for i, (a, b) in enumerate(zip(timings, reference)):
            if a.output_ids != b.output_ids:
                out.append(f"{name} request {i}: {a.output_ids[:8]}… vs dynamic single {b.output_ids[:8]}…")
    return out


def _open_loop(model, path: str, prompts, gen, batch_size: int, peak: float, levels: list[float], seed: int,
               slo: tuple) -> list[dict[str, Any]]:
    out = []
    for share in levels:
        arrivals = poisson_arrivals(len(prompts), share * peak, seed)
        fig = summarize(serve(model, path, prompts, gen, batch_size, arrivals), *slo)
        out.append({"load": share, "offered_requests_per_s": share * peak, **fig})
    return out


def _decode_profile(model, paths: list[str], prompts: list[list[int]], gen) -> dict[str, Any]:
    """Single requests of each ``generate`` path profiled (train/generate/decode_profile.py); empty: not asked."""
    from train.generate.decode_profile import explain, profile_single

    if not prompts:
        return {"paths": {}, "reason": "generate.profile_requests=0"}
    profiles = {p: profile_single(model, p, prompts, gen) for p in paths if p != "continuous"}
    return {"paths": profiles, "explanation": explain(profiles), "requests": len(prompts),
            "not_profiled": {"continuous": "its engine runs in a thread of its own, outside the capture"}
            if "continuous" in paths else {}}


def _fresh_process(cfg, run_dir: Optional[str], command: tuple[Optional[str], list[str]], out_dir: Path,
                   avail: dict[str, Optional[str]], notice: Callable[[str], None]) -> Optional[dict[str, Any]]:
    """The fresh-process first responses (train/generate/first_response.py), or None when not asked for."""
    from train.generate.first_response import FRESH_PATH, fresh_process_first_response

    if not cfg.generate.fresh_process:
        return None
    notice(f"bench-generate: two fresh processes on {FRESH_PATH}, the compile cache cold then warm")
    try:
        fresh = fresh_process_first_response(run_dir, *command, out_dir, unavailable=avail[FRESH_PATH])
    except RuntimeError as exc:  # a child that failed: this figure is null, the run goes on
        fresh = {"cold": None, "warm": None, "warm_over_cold_first_response": None,
                 "unavailable_reason": " ".join(str(exc).split())[:500]}
    if fresh.get("warm_over_cold_first_response") is not None:
        notice(f"bench-generate: first response of a fresh process {fresh['cold']['first_response_s']:.2f} s on a "
               f"cold cache, {fresh['warm']['first_response_s']:.2f} s on a warm one "
               f"(warm/cold {fresh['warm_over_cold_first_response']:.2f})")
    elif fresh.get("unavailable_reason"):
        notice(f"bench-generate: no fresh-process first-response figure: {fresh['unavailable_reason']}")
    return fresh


def load_decoder(run_dir: Optional[str], cfg):
    """The decoder to serve: :func:`train.generate.source.load_served`'s, or, for ``model.source=hf:<model_type>``
    (no run directory, no such local directory), one freshly initialised from the config — serving speed without a
    trained run (the GPU check's decoders)."""
    from train.generate.source import load_served, served_from_wrapper

    src = cfg.model.source
    if run_dir is None and src.startswith("hf:") and "/" not in src[3:] and not Path(src[3:]).exists() \
            and cfg.model.task == "causal-lm":
        from train.data import prepare_data
        from train.setup import build_model

        bundle = prepare_data(cfg, None, notice=lambda *a, **k: None)
        return served_from_wrapper(build_model(cfg, bundle), f"{src} (random init)")
    return load_served(run_dir, cfg)


def first_response_child(cfg, run_dir: Optional[str], t_start: float, out: str) -> None:
    """One process: the compile cache of ``cfg.compile.cache_dir``, the served model, one request on
    ``generate.path`` (the first held-out prompt); writes the timings (seconds) to ``out`` as JSON."""
    from train.compat import compile_cache_counts
    from train.compiling.session import setup_cache_dir
    from train.generate.engines import greedy_config, serve
    from train.generate.source import held_out_prompts
    from train.models.library import import_transformers

    g = cfg.generate
    cache = setup_cache_dir(cfg.compile.cache_dir)
    t_load = time.perf_counter()
    served = load_decoder(run_dir, cfg)
    prompts, _ = held_out_prompts(cfg, 2, g.prompt_fraction, served.context, g.max_new_tokens, g.truncate_prompts)
    gen = greedy_config(import_transformers(), g.max_new_tokens, served.eos_id, served.pad_id, g.ignore_eos)
    t_sent = time.perf_counter()
    first = serve(served.model, g.path, prompts[:1], gen, 1)[0]
    done = first.token_times[-1]
    atomic_write_text(out, json.dumps({
        "path": g.path, "time_to_first_response_s": done - t_start, "first_response_s": done - t_sent,
        "setup_s": t_sent - t_start, "model_and_prompts_s": t_sent - t_load, "output_tokens": len(first.output_ids),
        "cache_dir": cache.dir, "cache_state": cache.state, "cache_counts": compile_cache_counts()}, indent=2) + "\n")


def run_bench_generate(cfg, run_dir: Optional[str], out_dir: Path, notice: Callable[[str], None] = print,
                       command: tuple[Optional[str], list[str]] = (None, [])) -> dict[str, Any]:
    """The whole benchmark (module docstring); returns what ``generate.json`` holds. ``command``: the command
    line's ``--config`` and overrides, which the fresh first-response processes repeat.

    Raises:
        UserError: see :func:`train.generate.source.load_served` and ``held_out_prompts``; a forced
            ``generate.path`` that cannot run here."""
    from train.generate.source import held_out_prompts, place
    from train.models.library import import_transformers
    from train.tools.env import machine_load, resolve_device

    g = cfg.generate
    t0 = time.perf_counter()
    load_start = machine_load()
    device = resolve_device(cfg.train.device)
    served = place(load_decoder(run_dir, cfg), device, "fp32" if g.precision == "auto" else g.precision)
    prompts, prompt_facts = held_out_prompts(cfg, g.requests, g.prompt_fraction, served.context, g.max_new_tokens,
                                             g.truncate_prompts)
    if prompt_facts["split"] != "test" or prompt_facts["fewer_than_requested"]:
        notice(f"bench-generate: prompts from the {prompt_facts['split']} split"
               + (f"; {prompt_facts['fewer_than_requested']}" if prompt_facts["fewer_than_requested"] else
                  " (the test split is empty)"))
    gen = greedy_config(import_transformers(), g.max_new_tokens, served.eos_id, served.pad_id, g.ignore_eos)
    precision, precision_choice = _precision(cfg, served.model, device, prompts, gen)
    served = place(served, device, precision)
    threads, threads_choice = choose_threads(served.model, device, prompts, gen, cfg.bench.rounds)
    avail = available_paths(served.model)
    if g.path != "auto" and avail[g.path] is not None:
        raise UserError(f"generate.path={g.path}: {avail[g.path]}")
    paths = served_paths(g.path, avail)
    first = serve(served.model, paths[0], prompts[:1], gen, 1)[0]
    cold = {"first_response_s": first.token_times[-1] - t0, "includes": "model load, prompts, the first request"}
    fresh = _fresh_process(cfg, run_dir, command, out_dir, avail, notice)
    result = _measure(cfg, served.model, paths, prompts, gen, device, notice, threads)
    result["floor"] = _floor(served.model, prompts, g, device, result)  # after: its copy buffers stay out of the peak
    return {"source": served.source, "run_dir": run_dir, **_busy(load_start, machine_load()),
            "precision": precision, "precision_choice": precision_choice, "threads_choice": threads_choice,
            "device": str(device),
            "max_new_tokens": g.max_new_tokens, "ignore_eos": g.ignore_eos, "prompts": prompt_facts,
            "paths": {p: why for p, why in avail.items()}, **result,
            "first_response": {"cold": cold, "warm": result.pop("warm"), "fresh_process": fresh}}


REAL_MODEL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "bench-generate-smollm2.yaml"


def real_model_default(cfg) -> Optional[tuple[str, list[str]]]:
    """Without a run or ``--config``: the shipped SmolLM2-135M-Instruct config and the override naming its installed
    directory under ``data.cache_dir`` (``make models``), or None when it is not installed."""
    from train.models.pretrained import MODELS, installed

    d = installed(MODELS["smollm2-135m-instruct"], cfg.data.cache_dir)
    if d is None or not REAL_MODEL_CONFIG.is_file():
        return None
    return str(REAL_MODEL_CONFIG), [f"model.source=hf:{d}"]


def served_paths(path: str, avail: dict[str, Optional[str]]) -> list[str]:
    """The paths a run serves: every one that runs here for ``generate.path=auto``; a forced path and ``dynamic``,
    the reference the greedy comparison needs, otherwise."""
    runs = [p for p in PATHS if avail[p] is None]
    return runs if path == "auto" else [p for p in runs if p in ("dynamic", path)]


def summary_line(result: dict[str, Any], path: Path) -> str:
    """The console's last line of ``bench-generate``: the chosen path, its batched throughput and TPOT (or why
    there is none), whether greedy outputs agreed, where the files are."""
    b = result["batched"][result["chosen_path"]]
    tpot = b["tpot_ms"]["p50"]
    x = b.get("tpot_x_floor")
    floor = f" = {x:.2f}x the bandwidth floor" if x is not None else ""
    tpot_text = f"TPOT p50 {tpot:.1f} ms{floor}" if tpot is not None else \
        f"no TPOT ({b.get('tpot_unavailable_reason', 'no request produced two tokens')})"
    rate = b["output_tokens_per_s"]
    rate_text = f"{rate:.1f} output tokens/s" if rate is not None else "output tokens/s n/a (no measurable span)"
    same = {True: "identical", False: "DIFFERENT (generate.json names them)",
            None: "not compared bit for bit (not fp32)"}[result["correctness"]["identical_to_dynamic_single"]]
    return (f"bench-generate: chosen path {result['chosen_path']} ({result['choice']['reason']}); its batched run "
            f"served {rate_text}, {tpot_text}; greedy outputs {same} across paths{result['busy_note']}; wrote {path} "
            "and generate.png")


def _precision(cfg, model, device: torch.device, prompts, gen) -> tuple[str, dict[str, Any]]:
    """The served dtype: ``generate.precision`` as given, or for ``auto`` measured (train/generate/
    decode_choices.py)."""
    from train.generate.decode_choices import choose_precision

    g = cfg.generate
    if g.precision != "auto":
        return g.precision, {"chosen": g.precision, "reason": f"requested (generate.precision={g.precision})"}
    return choose_precision(model, device, prompts, gen, cfg.bench.rounds)


def _floor(model, prompts: list[list[int]], g, device: torch.device, result: dict[str, Any]) -> dict[str, Any]:
    """The bandwidth and matmul floors (train/generate/floor.py), and each path's TPOT p50 as a multiple of its own:
    batch 1 for the single runs, ``generate.batch_size`` for the static batches; continuous batching's batch varies
    (null, with the reason)."""
    from train.generate.floor import generation_floor, peaks_for, times_floor
    from train.tools.env import device_name

    floor = generation_floor(model, prompts, g.max_new_tokens, g.batch_size, peaks_for(model, device,
                                                                                         device_name(device)))
    for kind in ("single", "batched"):
        for path, figures in result[kind].items():
            if kind == "batched" and path == "continuous":
                figures["tpot_x_floor"] = None
                figures["tpot_x_floor_unavailable_reason"] = "continuous batching's batch varies from step to step"
            else:
                figures["tpot_x_floor"] = times_floor(figures, floor["tpot_floor_ms"][kind])
    return floor


def _busy(load_start: Optional[float], load_end: Optional[float]) -> dict[str, Any]:
    from train.tools.decisions import busy_note

    # the figures of a busy machine are said to be (the train command's note, without its caching clause)
    note = busy_note(max(load_start or 0.0, load_end or 0.0))
    busy = note.replace("; not cached: the machine was busy", "; the machine was busy").split(", so")[0]
    return {"load_1min": [load_start, load_end], "busy_note": busy}


def _measure(cfg, model, paths: list[str], prompts: list[list[int]], gen, device: torch.device,
             notice: Callable[[str], None], single_threads: Optional[int] = None) -> dict[str, Any]:
    """Warm-up, single and batched runs of every path, the decode profile, the choice, the open-loop runs, the
    correctness comparison, memory (the KV cache's share) and energy: ``generate.json``'s measured part."""
    from train.generate.resources import energy_per_output_token, kv_cache
    from train.perf.memory import peak_memory

    g = cfg.generate
    warm, single, batched = warm_single_batched(cfg, model, paths, prompts, gen,
                                                lambda m: notice(f"bench-generate: {m}"), single_threads)
    paths = list(single)  # a path that failed while warming up is left out (its warm-up entry says why)
    slo = (g.slo_ttft_ms, g.slo_tpot_ms)
    decode_profile = _decode_profile(model, paths, prompts[:g.profile_requests], gen)
    if g.path == "auto":
        chosen, choice = auto_path(cfg, model, paths, prompts, gen, device)
    elif g.path in paths:
        chosen, choice = g.path, {"reason": f"requested (generate.path={g.path})"}
    else:  # the forced path failed while warming up: the reference is what was served
        chosen, choice = "dynamic", {"reason": f"generate.path={g.path} failed ({warm[g.path]['error']}); dynamic "
                                               "served instead"}
    peak = summarize(batched[chosen])["requests_per_s"]
    load = _open_loop(model, chosen, prompts, gen, g.batch_size, peak, g.levels, cfg.train.seed, slo)
    baseline = _open_loop(model, "dynamic", prompts, gen, g.batch_size, peak, g.levels, cfg.train.seed, slo) \
        if chosen != "dynamic" else load
    energy = energy_per_output_token(device, lambda: sum(
        t.output_tokens for t in serve(model, chosen, prompts, gen, g.batch_size)))
    mismatch = _mismatches({**{f"{p} single": t for p, t in single.items()},
                            **{f"{p} batched": t for p, t in batched.items()}}, single["dynamic"])
    exact = next(model.parameters()).dtype == torch.float32
    return {"chosen_path": chosen, "choice": choice, "warm": warm,
            "single": {p: summarize(t, *slo) for p, t in single.items()},
            "batched": {p: {**summarize(t, *slo), "batch_size": g.batch_size if p != "continuous" else None}
                        for p, t in batched.items()},
            "open_loop": {"path": chosen, "levels": load, "baseline_path": "dynamic (static batching)",
                          "baseline": baseline, "arrivals": "Poisson, precomputed, seed train.seed"},
            "correctness": {"identical_to_dynamic_single": not mismatch if exact else None, "mismatches": mismatch[:10],
                            "compared": f"greedy output ids, {next(model.parameters()).dtype}, every path single and "
                                        "batched"
                            + ("" if exact else "; identity is asked of fp32 only (rounding differs between kernels)")},
            "decode_profile": decode_profile, **peak_memory(device),
            "kv_cache": kv_cache(model, paths, prompts, g.max_new_tokens, g.batch_size, next(model.parameters()).dtype),
            **energy}


def write_outputs(result: dict[str, Any], out_dir: Path) -> Path:
    """``generate.json`` and ``generate.png`` in ``out_dir`` (each written atomically)."""
    from train.generate.plots import plot_generate
    from train.generate.source import dumps

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "generate.json"
    atomic_write_text(path, dumps(result))
    plot_generate(result, out_dir / "generate.png")
    return path

"""``python -m train bench`` (``make bench``): the five-part performance report, naive vs optimized, in one run.

Writes ``runs/<id>/bench/``: ``bench.json`` (``training.configs`` rows and ``inference``),
``bench.md`` (one table per benchmark) and PNG plots (throughput bars, latency CDF, memory bars).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from train.bench.decoder_inference import check_decoder_bench, decoder_markdown, run_decoder_inference
from train.bench.inference import run_inference_bench
from train.bench.rows import CONFIGS
from train.bench.training import (
    add_ratios,
    arm_config,
    auto_precision,
    run_training_bench,
    runnable_rows,
)
from train.config import RunConfig
from train.data import prepare_data
from train.data.causal_collate import CAUSAL_LM
from train.data.tokenizer import load_or_train
from train.errors import atomic_path, atomic_write_text
from train.models.external import with_model_tokenizer
from train.setup import start_run
from train.tools.env import collect_env, machine_facts


def run_bench_suite(cfg: RunConfig, notice: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the training (and inference) benchmarks with the ``bench`` settings and write ``<run_dir>/bench/``.
    Returns bench.json's dict; ``training.skipped`` maps each row the model cannot run (packed rows on a model without
    ``supports_packing``) to the reason.

    Raises:
        UserError: an unknown configuration in ``bench.configs``, only rows the model cannot run, bad data or config.
    """
    b = cfg.bench
    if cfg.model.task == CAUSAL_LM and not b.skip_inference:
        check_decoder_bench(cfg)
    names, skipped = runnable_rows(cfg, b.config_names() or list(CONFIGS), notice)  # e.g. packed rows on hf: models
    start = start_run(cfg, prefix="bench-")
    run_dir, device = start.run_dir, start.device
    out_dir = run_dir / "bench"
    bundle = prepare_data(cfg, None, notice=notice)
    machine_at_start = machine_facts(device)
    t0 = time.perf_counter()
    row_cfgs = [arm_config(cfg, list(CONFIGS[n].overrides)) for n in names]
    # one decision for every auto row, and the record of it (the start's own, when the config asks for auto)
    auto = start.policy if cfg.train.precision == "auto" else auto_precision(cfg, device, row_cfgs)
    rows = run_training_bench(cfg, bundle, device, names, notice, auto=auto)
    add_ratios(rows)
    result: dict[str, Any] = {
        "training": {"configs": rows, "skipped": skipped,
                     "precision_auto": None if auto is None else {"precision": auto.mode, "reason": auto.reason,
                                                                  "source": auto.source},
                     "settings": {"warmup_steps": b.warmup_steps, "rounds": b.rounds, "window": b.window,
                                  "batch_size": cfg.batching.batch_size,
                                  "max_tokens": cfg.batching.max_tokens, "model": cfg.model.preset,
                                  "interleaved": True, "seconds": time.perf_counter() - t0}},
        "env": {**collect_env(device), "num_threads": __import__("torch").get_num_threads(), **machine_at_start,
                "load_1min_at_end": None},
    }
    if b.skip_inference:
        result["inference"] = None
        result["inference_unavailable_reason"] = "skipped (bench.skip_inference)"
    else:
        tok, _ = load_or_train(bundle.corpus.train.texts, cfg.data.vocab_size, cfg.data.cache_dir,
                               with_model_tokenizer(cfg).data.tokenizer_path)
        result["inference"] = run_decoder_inference(cfg, bundle, notice) if cfg.model.task == CAUSAL_LM \
            else run_inference_bench(cfg, bundle, tok, device, notice)
    result["env"]["load_1min_at_end"] = machine_facts(device)["load_1min"]
    result["run_dir"] = str(run_dir)
    write_outputs(out_dir, result)
    return result


def _lever_ratio(row: dict[str, Any]) -> str:
    """``1.05 [1.01, 1.09]`` (paired, with its interval; ``n.s.`` when it includes 1.0), or ``—``."""
    v = row.get("vs_parent")
    if not v or v.get("median") is None:
        return "—"
    if v.get("low") is None:
        return f"{v['median']:.2f} (1 round: no interval)"
    return (f"{v['median']:.2f} [{v['low']:.2f}, {v['high']:.2f}]"
            + (" n.s." if v["verdict"] == "no measurable difference" else ""))


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    """bench.md: one table for training, one for inference."""
    env = result["env"]
    load = f"load {_fmt(env.get('load_1min'), '.2f')} → {_fmt(env.get('load_1min_at_end'), '.2f')}"
    lines = [f"# Benchmark — {env['device']}, torch {env['torch']}", "",
             f"CPU flags: {', '.join(env.get('cpu_flags') or []) or 'n/a'}; {env.get('torch_threads')} torch threads; "
             f"1-minute {load} (start → end).", "",
             "## Training (interleaved, same process; medians over windows after warm-up)", "",
             "Each row's own lever is its paired per-round ratio against the row that differs from it by that lever "
             "alone (`vs row`), with its 95 % interval; `n.s.`: the interval includes 1.0 (no measurable difference).",
             "",
             "| config | samples/s | × naive | × hf-style | lever (vs row) | × lever | tokens/s | first step s "
             "| p50 ms | p90 ms | p99 ms | token eff. | shapes | peak mem MiB | J/sample | MFU (measured peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["training"]["configs"]:
        st = r["step_time_ms"]
        lever = f"{r['lever']} (vs {r['parent']})" if r.get("parent") else "reference"
        lines.append(f"| {r['name']} | {_fmt(r['samples_per_s'])} | {_fmt(r.get('samples_per_s_vs_naive'), '.2f')} "
                     f"| {_fmt(r.get('samples_per_s_vs_hf-style'), '.2f')} | {lever} "
                     f"| {_lever_ratio(r)} | {_fmt(r['tokens_per_s'], '.0f')} "
                     f"| {_fmt(r['time_to_first_step_s'], '.2f')} | {_fmt(st['p50'])} | {_fmt(st['p90'])} "
                     f"| {_fmt(st['p99'])} "
                     f"| {_fmt(r['token_efficiency'], '.3f')} | {r['distinct_shapes']} "
                     f"| {r['peak_memory_bytes'] / 2**20:.0f} "
                     f"| {_fmt(r.get('energy_j_per_sample'), '.3g')} | {_fmt(r['mfu_vs_measured_peak'], '.1%')} |")
    lines += ["", "Rows:", ""] + [f"* `{r['name']}`: {r['description']}" for r in result["training"]["configs"]]
    lines += [f"* `{n}`: not run: {why}" for n, why in (result["training"].get("skipped") or {}).items()]
    reason = next((r.get("energy_unavailable_reason") for r in result["training"]["configs"]
                   if r.get("energy_unavailable_reason")), None)
    if reason:
        lines += ["", f"Energy: not measured — {reason}."]
    inf = result.get("inference")
    if inf and inf.get("kind") == "decoder":
        lines += decoder_markdown(inf)
    elif inf:
        lines += ["", "## Inference", "", f"Model: {inf['model']}; precision {inf['precision']}; "
                  f"time to first response {inf['time_to_first_response_s']:.2f} s "
                  f"(first request {inf['first_request_ms']:.1f} ms); "
                  f"accuracy on the requests {inf['accuracy_on_requests']:.3f}.", "",
                  "| mode | requests | requests/s | p50 ms | p90 ms | p99 ms | peak mem MiB | J/request |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode in ("single", "batched"):
            m = inf[mode]
            lat = m["latency_ms"]
            how = {"packed": "packed rows, one forward",
                   "bucket": "grouped by bucket"}.get(m.get("batching"), m.get("batching"))
            label = mode if mode == "single" else f"batched ({m['batch_size']}/call, {how}; latency per call)"
            lines.append(f"| {label} | {m['requests']} | {_fmt(m['requests_per_s'])} | {_fmt(lat['p50'], '.2f')} "
                         f"| {_fmt(lat['p90'], '.2f')} | {_fmt(lat['p99'], '.2f')} "
                         f"| {m['peak_memory_bytes'] / 2**20:.0f} "
                         f"| {_fmt(m.get('energy_j_per_request'), '.3g')} |")
        if inf.get("load"):
            ls = inf["load_settings"]
            lines += ["", f"Batched / single requests/s: {_fmt(inf.get('batched_vs_single_requests_per_s'), '.2f')}×. "
                      "Open loop: Poisson arrivals at shares of the batched maximum "
                      f"({ls['max_rate_requests_per_s']:.0f} "
                      f"requests/s), dynamic batching up to {ls['max_batch']} with a {ls['max_queue_delay_ms']:g} ms "
                      "maximum queueing delay; latency from arrival to answer.", "",
                      "| load | offered req/s | achieved req/s | p50 ms | p99 ms | mean batch |",
                      "|---|---|---|---|---|---|"]
            for lv in inf["load"]:
                lines.append(f"| {lv['load']:.0%} | {lv['offered_requests_per_s']:.0f} | "
                             f"{_fmt(lv['achieved_requests_per_s'], '.0f')} | {_fmt(lv['latency_ms']['p50'], '.2f')} "
                             f"| {_fmt(lv['latency_ms']['p99'], '.2f')} | {lv['mean_batch_size']:.1f} |")
    return "\n".join(lines) + "\n"


def plots(out_dir: Path, result: dict[str, Any]) -> list[str]:
    """throughput.png, memory.png and (with inference) latency_cdf.png; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["training"]["configs"]
    names = [r["name"] for r in rows]
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        with atomic_path(out_dir / name) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, [r["samples_per_s"] for r in rows], color="tab:blue")
    ax.set_xlabel("training samples/s (median over windows)")
    ax.invert_yaxis()
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, values = list(names), [r["peak_memory_bytes"] / 2**20 for r in rows]
    inf = result.get("inference")
    if inf and inf.get("kind") == "decoder":  # its latency CDF and throughput-vs-p99 plot are bench-generate's
        inf = None
    if inf:
        labels += ["inference single", "inference batched"]
        values += [inf["single"]["peak_memory_bytes"] / 2**20, inf["batched"]["peak_memory_bytes"] / 2**20]
    ax.barh(labels, values, color="tab:orange")
    ax.set_xlabel(f"peak memory, MiB ({rows[0]['peak_memory_source']})")
    ax.invert_yaxis()
    save(fig, "memory.png")

    if inf:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode in ("single", "batched"):
            lat = np.sort(np.asarray(inf[mode]["latencies_ms"]))
            ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label=mode)
        ax.set_xscale("log")
        ax.set_xlabel("latency per call, ms")
        ax.set_ylabel("fraction of calls")
        ax.legend()
        save(fig, "latency_cdf.png")
    return written


def write_outputs(out_dir: Path, result: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    result["plots"] = plots(out_dir, result)
    atomic_write_text(out_dir / "bench.md", markdown(result))
    atomic_write_text(out_dir / "bench.json", json.dumps(result, indent=2) + "\n")


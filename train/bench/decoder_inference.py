"""``make bench``'s inference rows for a decoder (``model.task=causal-lm``): the model of ``bench.checkpoint`` (or a
freshly initialised one) answering ``bench.requests`` held-out prompts on every serving path that runs here
(train/generate/engines.py), greedy, ``generate.max_new_tokens`` each:

* **single**: one request at a time (closed loop, batch 1): TTFT, TPOT and E2E percentiles;
* **batched**: every request at once (closed loop, the maximum rate; ``generate.batch_size`` per ``generate`` call,
  continuous batching takes them all): output tokens/s, TPOT;
* the batched output tokens/s of each path against ``dynamic``: paired ratios over ``bench.rounds`` interleaved
  rounds (the A/B primitive), with their interval.

The open-loop runs, the fresh-process first response and the decode profile are ``bench-generate``'s
(``make bench-generate``); these rows are the short form that sits beside the training rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from train.errors import UserError


def _served(cfg, bundle):
    """The decoder to serve: ``bench.checkpoint``'s, or one built from the config (freshly initialised)."""
    from train.generate.source import served_from_checkpoint, served_from_wrapper
    from train.setup import build_model

    if cfg.bench.checkpoint:
        return served_from_checkpoint(cfg.bench.checkpoint, "bench.checkpoint")
    return served_from_wrapper(build_model(cfg, bundle), "freshly initialised (no bench.checkpoint)")


def _row(fig: dict[str, Any]) -> dict[str, Any]:
    keep = ("requests", "output_tokens", "output_tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms", "itl_ms",
            "e2e_ms", "span_s")
    return {k: fig[k] for k in keep}


def run_decoder_inference(cfg, bundle, notice: Callable[[str], None] = print) -> dict[str, Any]:
    """The decoder rows (module docstring); what ``bench.json`` keeps under ``inference``.

    Raises:
        UserError: ``bench.checkpoint`` is not a decoder's checkpoint; prompts too long for the model's context."""
    from train.generate.engines import PATHS, greedy_config
    from train.generate.figures import summarize
    from train.generate.serving import available_paths, choose_path, warm_single_batched
    from train.generate.source import held_out_prompts
    from train.models.library import import_transformers

    g = cfg.generate
    served = _served(cfg, bundle)
    prompts, facts = held_out_prompts(cfg, max(2, cfg.bench.requests), g.prompt_fraction, served.context,
                                      g.max_new_tokens, g.truncate_prompts, bundle)
    gen = greedy_config(import_transformers(), g.max_new_tokens, served.eos_id, served.pad_id, g.ignore_eos)
    avail = available_paths(served.model)
    paths = [p for p in PATHS if avail[p] is None]
    _, single, batched = warm_single_batched(cfg, served.model, paths, prompts, gen, lambda _m: None)
    rows: dict[str, Any] = {}
    for path in paths:
        rows[path] = {"single": _row(summarize(single[path])),
                      "batched": {**_row(summarize(batched[path])),
                                  "batch_size": g.batch_size if path != "continuous" else None}}
        s = rows[path]["single"]
        notice(f"bench: decoder {path}: single TTFT p50 {s['ttft_ms']['p50']:.1f} ms, TPOT p50 "
               f"{_fmt(s['tpot_ms']['p50'])} ms; batched {rows[path]['batched']['output_tokens_per_s']:.0f} "
               "output tokens/s")
    best, choice = choose_path(served.model, paths, prompts, gen, g.batch_size, cfg.bench.rounds)
    return {"kind": "decoder", "model": served.source, "precision": "fp32", "device": "cpu",
            "max_new_tokens": g.max_new_tokens, "ignore_eos": g.ignore_eos, "prompts": facts, "paths": rows,
            "not_run": {p: why for p, why in avail.items() if why is not None},
            "batched_output_tokens_per_s_vs_dynamic": choice["vs_dynamic"], "fastest_batched": best,
            "choice_reason": choice["reason"]}


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def decoder_markdown(inf: dict[str, Any]) -> list[str]:
    """bench.md's decoder inference table: a row per path and mode, then the paired ratios."""
    lines = ["", "## Inference (decoder)", "",
             f"Model: {inf['model']}; {inf['precision']}; greedy, {inf['max_new_tokens']} new tokens"
             f"{' (EOS ignored)' if inf['ignore_eos'] else ', EOS ends a request'}; "
             f"{inf['prompts']['prompts']} held-out prompts ({inf['prompts']['prompt_tokens_mean']:.1f} tokens mean).",
             "", "| path | mode | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | E2E p50 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for path, modes in inf["paths"].items():
        for mode, r in modes.items():
            lines.append(f"| {path} | {mode} | {_fmt(r['output_tokens_per_s'])} | {_fmt(r['ttft_ms']['p50'])} "
                         f"| {_fmt(r['ttft_ms']['p99'])} | {_fmt(r['tpot_ms']['p50'])} | {_fmt(r['tpot_ms']['p99'])} "
                         f"| {_fmt(r['e2e_ms']['p50'])} |")
    for path, ratio in inf["batched_output_tokens_per_s_vs_dynamic"].items():
        lines.append(f"\nBatched output tokens/s, {path} / dynamic: {_fmt(ratio['median'], '.2f')} "
                     f"[{_fmt(ratio['low'], '.2f')}, {_fmt(ratio['high'], '.2f')}]: {ratio['verdict']}")
    lines += [f"\n{inf['choice_reason']}."]
    lines += [f"\nNot run: {p}: {why}" for p, why in inf["not_run"].items()]
    return lines


def check_decoder_bench(cfg) -> None:
    """Refuse, before any step, a decoder bench whose inference cannot run.

    Raises:
        UserError: ``bench.checkpoint`` given but not a file."""
    import os

    if cfg.bench.checkpoint and not os.path.isfile(cfg.bench.checkpoint):
        raise UserError(f"bench.checkpoint={cfg.bench.checkpoint}: no such file (give a causal-LM run's "
                        "runs/<id>/checkpoint.pt, or leave it unset for a freshly initialised model)")

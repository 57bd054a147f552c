"""The lines a run prints at its end, read from its report.json."""

from __future__ import annotations

import os
from typing import Any, Optional


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What a finished run prints: quality, throughput and step times, token efficiency, compile, the report's path."""
    q, p, b = report["quality"], report["perf"], report["batching"]

    def f(x: Optional[float], fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    if report.get("task") == "causal-lm":  # held-out loss per target token; tokens/s counts trained targets
        quality = (f"test loss {f(q.get('test_loss'), '.4f')} per target token (perplexity "
                   f"{f(q.get('test_perplexity'), '.2f')}), eval perplexity {f(q.get('eval_perplexity'), '.2f')}, "
                   f"test next-token accuracy {f(q['test_accuracy'], '.4f')}")
        tokens = (f"{f(p['throughput_tokens_per_s'], '.0f')} tokens/s "
                  f"({f(p.get('throughput_target_tokens_per_s'), '.0f')} trained target tokens/s)")
    else:
        quality = (f"test accuracy {f(q['test_accuracy'], '.4f')} (majority class "
                   f"{f(q['test_majority_class_accuracy'], '.4f')}), test macro-F1 {f(q['test_macro_f1'], '.4f')}, "
                   f"eval accuracy {f(q['eval_accuracy'], '.4f')}")
        tokens = f"{f(p['throughput_tokens_per_s'], '.0f')} tokens/s"
    if q.get("eval_loss_before") is not None:  # train.eval_before: what the run improved on
        quality += f"; held-out loss {f(q['eval_loss_before'], '.4f')} before training → {f(q['eval_loss'], '.4f')}"
    return [
        quality,
        *_answer_lines(q.get("answers")),
        f"throughput {f(p['throughput_samples_per_s'], '.1f')} samples/s, {tokens}; "
        f"step p50 {f(p['step_time_ms']['p50'], '.1f')} ms, p99 {f(p['step_time_ms']['p99'], '.1f')} ms; "
        f"first step after {f(p['time_to_first_step_s'], '.1f')} s; "
        f"peak memory {p['peak_memory_bytes'] / 2**20:.0f} MiB{_tensor_memory(report)}",
        f"token efficiency {f(b['token_efficiency'], '.3f')} with {b['distinct_shapes']} sequence "
        f"length{'' if b['distinct_shapes'] == 1 else 's'}; "
        f"wall time {p['wall_time_s']:.0f} s",
        *_compile_line(report.get("compile")),
        f"report: {os.path.join(report['run_dir'], 'report.json')}",
    ]


def _tensor_memory(report: dict[str, Any]) -> str:
    """The tensors' share of the peak (report.json ``model.memory``), where it was counted apart from the RSS."""
    m = (report.get("model") or {}).get("memory") or {}
    if m.get("tensor_bytes") is None:
        return ""
    mib = {k: (m[k] or 0) / 2**20 for k in ("frozen_weights_bytes", "trainable_weights_bytes", "gradients_bytes",
                                             "optimizer_state_bytes", "activations_bytes")}
    return (f" (tensors {m['tensor_bytes'] / 2**20:.0f} MiB: weights "
            f"{mib['frozen_weights_bytes'] + mib['trainable_weights_bytes']:.0f}, gradients "
            f"{mib['gradients_bytes']:.0f}, optimizer {mib['optimizer_state_bytes']:.0f}, activations "
            f"{mib['activations_bytes']:.0f})")


def _answer_lines(answers: Optional[dict]) -> list[str]:
    """A causal LM's fixed prompts, the answer before → after (train/generate/answers.py), one line each."""
    before, after = ((answers or {}).get(k) or {} for k in ("before", "after"))
    pairs = zip(before.get("answers") or [], after.get("answers") or [])
    return [f"answer {i}: {b['answer'].strip()[:60]!r} → {a['answer'].strip()[:60]!r} (reference "
            f"{a['reference'].strip()[:40]!r})" for i, (b, a) in enumerate(pairs, 1)]


def _compile_line(c: Optional[dict]) -> list[str]:
    if not c or not c.get("enabled"):
        return []
    warm = "n/a" if c["warmup_s"] is None else f"{c['warmup_s']:.0f} s"
    return [f"compile: {c['status']}; warm-up {warm}, recompiles after warm-up {c['recompiles_after_warmup']}, "
            f"cache {c['cache_state']} ({c['cache_dir']})"]

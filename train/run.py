"""One training run end to end: run directory → data → model → loop → evaluation → report.json.

Writes ``runs/<run-id>/``: ``config.yaml`` (fully resolved), ``metrics.jsonl``, ``buckets.json``
(when fitted on the fly), ``checkpoint.pt`` (state_dicts only) and ``report.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from train.checkpoint import save_checkpoint
from train.config import RunConfig, dump_config
from train.data import DataBundle, make_loader, prepare_data
from train.env import collect_env, resolve_device
from train.errors import UserError, atomic_write_text
from train.model import EncoderClassifier, resolve_spec
from train.perf.memory import peak_memory, reset_peak
from train.precision import PrecisionPolicy
from train.tracking import JsonlLogger
from train.trainer import Trainer, TrainStats, evaluate
from train.warmup import start_compile, warm_up_for_run


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_run_dir(cfg: RunConfig) -> Path:
    """Create ``<output_dir>/<run_id>`` (run_id defaults to a UTC timestamp).

    Raises:
        UserError: the directory cannot be created or written.
    """
    run_id = cfg.train.run_id or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = Path(cfg.train.output_dir) / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write the run directory {run_dir} ({exc.strerror}); "
                        "set train.output_dir to a writable place") from None
    return run_dir


def build_model(cfg: RunConfig, bundle: DataBundle) -> EncoderClassifier:
    m = cfg.model
    spec = resolve_spec(m.preset, bundle.vocab_size, bundle.num_classes, cfg.data.max_len, m.dropout, m.pooling,
                        num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads, ffn_size=m.ffn_size)
    if spec.hidden_size % spec.num_heads:
        raise UserError(f"model: hidden_size {spec.hidden_size} is not divisible by num_heads {spec.num_heads}")
    if max(bundle.bounds) > spec.max_len:
        raise UserError(f"bucket bound {max(bundle.bounds)} exceeds data.max_len={spec.max_len} (the position table); "
                        "refit the buckets or raise data.max_len")
    return EncoderClassifier(spec)


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def build_report(cfg: RunConfig, run_dir: Path, bundle: DataBundle, stats: TrainStats, timer_summary: dict,
                 first_step_ms: Optional[float], steady_ms_total: float, final_eval: dict, test_eval: dict,
                 env: dict, memory: dict, sampler_counts: dict, t_start: float, wall_s: float) -> dict[str, Any]:
    """The run's report.json (keys are a contract: add, never rename)."""
    train_split = bundle.splits["train"]
    test_labels = bundle.splits["test"].labels
    majority = float(np.bincount(test_labels).max() / len(test_labels)) if len(test_labels) else None
    steady_s = steady_ms_total / 1e3
    perf = {
        "throughput_samples_per_s": _ratio(stats.steady_samples, steady_s),
        "throughput_tokens_per_s": _ratio(stats.steady_real_tokens, steady_s),
        "time_to_first_step_s": (stats.first_step_end - t_start) if stats.first_step_end else None,
        "first_step_ms": first_step_ms,
        "step_time_ms": timer_summary,
        "steps": stats.steps,
        "wall_time_s": wall_s,
        **memory,
    }
    if stats.steps < 2:
        perf["throughput_unavailable_reason"] = "fewer than 2 steps: no steady-state steps after the first (cold) one"
    return {
        "status": "completed",
        "run_id": run_dir.name,
        "run_dir": str(run_dir),
        "quality": {
            "eval_accuracy": final_eval.get("accuracy"),
            "eval_macro_f1": final_eval.get("macro_f1"),
            "eval_loss": final_eval.get("loss"),
            "final_train_loss": stats.final_train_loss,
            "test_accuracy": test_eval.get("accuracy"),
            "test_macro_f1": test_eval.get("macro_f1"),
            "test_majority_class_accuracy": majority,
            "evals": stats.evals,
        },
        "data": {
            "name": bundle.corpus.name,
            "source": cfg.data.source,
            "train_samples": len(train_split),
            "validation_samples": len(bundle.splits["validation"]),
            "test_samples": len(bundle.splits["test"]),
            "num_classes": bundle.num_classes,
            "label_names": bundle.corpus.label_names,
            "truncated_samples": sum(s.truncated for s in bundle.splits.values()),
            "truncated_train_samples": train_split.truncated,
            "mean_train_length": float(train_split.lengths.mean()),
            "max_train_length": int(train_split.lengths.max()),
            "data_fingerprint": bundle.data_fingerprint,
            "tokenizer": bundle.tokenizer_info,
        },
        "batching": {
            "method": cfg.batching.method,
            "num_buckets": len(bundle.bounds) if bundle.plan is not None else None,
            "bucket_bounds": bundle.bounds,
            "boundaries_source": bundle.plan_source,
            "predicted_token_efficiency": bundle.plan.predicted_token_efficiency if bundle.plan else None,
            "token_efficiency": _ratio(stats.real_tokens, stats.padded_tokens),
            "padding_ratio": 1 - stats.real_tokens / stats.padded_tokens if stats.padded_tokens else None,
            "distinct_shapes": len(stats.seq_lens),
            "distinct_batch_shapes": len(stats.batch_shapes),
            "batch_size": cfg.batching.batch_size,
            "max_tokens": cfg.batching.max_tokens,
            "dropped_samples": sampler_counts["dropped"],
            "repeated_samples": sampler_counts["repeated"],
            "truncated_in_collate": stats.truncated_in_collate,
        },
        "perf": perf,
        "env": env,
    }


def run_training(cfg: RunConfig, t_start: float, buckets_force: bool = False) -> dict[str, Any]:
    """Train, evaluate and write the run directory. Returns the report dict.

    ``t_start`` is ``time.perf_counter()`` at command start, for ``perf.time_to_first_step_s``.

    Raises:
        UserError: any bad input (config, data, buckets, run directory).
    """
    run_dir = make_run_dir(cfg)
    atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
    for stale in ("report.json", "metrics.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    device = resolve_device(cfg.train.device)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    policy = PrecisionPolicy.create(cfg.train.precision, device)
    print(f"run {run_dir}: device {device}, precision {policy.mode} ({policy.reason})", flush=True)

    t_data = time.perf_counter()
    bundle = prepare_data(cfg, run_dir, buckets_force)
    data_s = time.perf_counter() - t_data
    print(f"data: {bundle.corpus.name}, {len(bundle.splits['train'])} train / {len(bundle.splits['validation'])} val / "
          f"{len(bundle.splits['test'])} test, {bundle.num_classes} classes, vocab {bundle.vocab_size} "
          f"(tokenizer {bundle.tokenizer_info['source']}), {data_s:.1f}s", flush=True)

    model = build_model(cfg, bundle).to(device)
    train_loader = make_loader(bundle, "train", cfg, train=True, device=device)
    val_loader = make_loader(bundle, "validation", cfg, train=False, device=device)
    test_loader = make_loader(bundle, "test", cfg, train=False, device=device)
    compiled = start_compile(cfg, device, model, bundle.pad_to, train_loader, [val_loader, test_loader])
    print(f"compile: {'on' if compiled.enabled else 'off'} ({compiled.reason})", flush=True)
    logger = JsonlLogger(run_dir / "metrics.jsonl")
    trainer = Trainer(cfg, compiled.forward, policy, device, train_loader, val_loader, logger, bundle.num_classes)
    print(f"model: {cfg.model.preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"{trainer.total_steps} steps ({len(train_loader)} batches per epoch)", flush=True)
    warm_up_for_run(compiled, trainer, model, run_dir)
    reset_peak(device)
    try:
        stats = trainer.fit()
    finally:
        logger.close()
    sampler = train_loader.batch_sampler
    sampler_counts = {"dropped": sampler.dropped_samples, "repeated": sampler.repeated_samples}
    final_eval = stats.evals[-1] if stats.evals else evaluate(compiled.forward, val_loader, policy, bundle.num_classes, device)
    test_eval = evaluate(compiled.forward, test_loader, policy, bundle.num_classes, device)
    memory = peak_memory(device)
    env = {**collect_env(device), "precision": policy.mode, "precision_reason": policy.reason,
           "num_threads": torch.get_num_threads()}
    save_checkpoint(run_dir / "checkpoint.pt", {
        "model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(), "step": stats.steps, "epoch": trainer.epoch,
        "spec": asdict(model.spec), "label_names": list(bundle.corpus.label_names), "config": cfg.to_dict()})
    report = build_report(cfg, run_dir, bundle, stats, trainer.timer.summary(), trainer.timer.first_ms,
                          sum(trainer.timer.steady_ms), final_eval, test_eval, env, memory, sampler_counts, t_start,
                          time.perf_counter() - t_start)
    report["perf"]["data_prep_s"] = data_s
    report["compile"] = compiled.report()
    for line in compiled.loud_warnings():
        print(line, file=sys.stderr, flush=True)
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    q, p, b = report["quality"], report["perf"], report["batching"]

    def f(x: Optional[float], fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    return [
        f"test accuracy {f(q['test_accuracy'], '.4f')} (majority class {f(q['test_majority_class_accuracy'], '.4f')}), "
        f"test macro-F1 {f(q['test_macro_f1'], '.4f')}, eval accuracy {f(q['eval_accuracy'], '.4f')}",
        f"throughput {f(p['throughput_samples_per_s'], '.1f')} samples/s, {f(p['throughput_tokens_per_s'], '.0f')} tokens/s; "
        f"step p50 {f(p['step_time_ms']['p50'], '.1f')} ms, p99 {f(p['step_time_ms']['p99'], '.1f')} ms; "
        f"first step after {f(p['time_to_first_step_s'], '.1f')} s; peak memory {p['peak_memory_bytes'] / 2**20:.0f} MiB",
        f"token efficiency {f(b['token_efficiency'], '.3f')} with {b['distinct_shapes']} sequence lengths; "
        f"wall time {p['wall_time_s']:.0f} s",
        *_compile_line(report.get("compile")),
        f"report: {os.path.join(report['run_dir'], 'report.json')}",
    ]


def _compile_line(c: Optional[dict]) -> list[str]:
    if not c or not c.get("enabled"):
        return []
    warm = "n/a" if c["warmup_s"] is None else f"{c['warmup_s']:.0f} s"
    return [f"compile: {c['status']}; warm-up {warm}, recompiles after warm-up {c['recompiles_after_warmup']}, "
            f"cache {c['cache_state']} ({c['cache_dir']})"]

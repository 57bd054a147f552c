"""report.json, built from one :class:`ReportInputs` (keys are a contract: add, never rename): the run's quality, data,
batching, perf and env sections, the efficiency fields (MFU, energy), and the aborted-run report."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from train.config import RunConfig
from train.data.bundle import DataBundle
from train.data.loaders import pack_layout
from train.data.sampler import run_counts
from train.errors import atomic_write_text
from train.models.encoder import EncoderClassifier
from train.models.flops import step_flops_for
from train.numerics import NumericsAbort
from train.perf.devices import mfu_fields
from train.perf.energy import per_unit
from train.perf.flops import VARLEN_FLOPS_METHOD
from train.perf.memory import peak_memory
from train.perf.timer import StepTimer
from train.precision import PrecisionPolicy
from train.step_record import TrainStats
from train.tools.env import collect_env
from train.trainer import Trainer


@dataclass
class ReportInputs:
    """Everything report.json is built from.

    Attributes:
        timer: the loop's step timer (first step, steady-state steps, percentiles in ms).
        final_eval, test_eval: ``evaluate()`` results (empty dicts when not evaluated).
        env: report ``env`` (environment facts and the precision policy's fields).
        memory: ``peak_memory(device)``; sampler_counts: ``{"dropped", "repeated"}`` over the run.
        t_start: ``time.perf_counter()`` at command start; wall_s: seconds since then.
        data_prep_s: data loading + tokenization seconds; efficiency: :func:`efficiency_fields`.
        sections: whole top-level sections (``numerics``, ``clip``, ``tracking``, ``compile``, ``resumed_from``).
        interrupted: the ``interrupted`` section after SIGTERM/SIGINT, else None.
    """

    cfg: RunConfig
    run_dir: Path
    bundle: DataBundle
    stats: TrainStats
    timer: StepTimer
    final_eval: dict
    test_eval: dict
    env: dict
    memory: dict
    sampler_counts: dict
    t_start: float
    wall_s: float
    data_prep_s: Optional[float] = None
    efficiency: dict = field(default_factory=dict)
    sections: dict = field(default_factory=dict)
    interrupted: Optional[dict] = None
    batching_auto: Optional[dict] = None
    """``batching.method=auto``'s decision (train/data/batching_auto.py), reported as ``batching.auto``."""
    packed_attention: Optional[dict] = None
    """Packed rows' attention decision (``AttentionChoice.as_report()``, train/data/attention.py)."""


def sampler_counts(loader, epochs: int = 1) -> dict[str, int]:
    """``dropped`` (drop_last) and ``repeated`` (evening out ranks) samples of a training loader over the whole run:
    summed over its ``epochs`` epochs (0 … epochs - 1, every epoch it began)."""
    return run_counts(loader.batch_sampler, epochs)


def _unk_only_words(bundle: DataBundle) -> Optional[int]:
    """``[UNK]`` tokens over all splits (words the tokenizer cannot spell); None from a cache entry written before
    they were counted."""
    counts = [s.unk_only_words for s in bundle.splits.values()]
    return None if any(c is None for c in counts) else int(sum(counts))


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def build_report(r: ReportInputs) -> dict[str, Any]:
    """The run's report.json (keys are a contract: add, never rename) from one :class:`ReportInputs`."""
    report = {
        "status": "completed",
        "run_id": r.run_dir.name,
        "run_dir": str(r.run_dir),
        "task": r.cfg.model.task,
        "quality": _quality(r),
        "data": _data(r.cfg, r.bundle),
        "batching": _batching(r),
        "perf": _perf(r),
        "env": r.env,
    }
    report.update(r.sections)
    if r.interrupted is not None:
        report["status"] = "interrupted"
        report["interrupted"] = r.interrupted
        report["quality"]["test_unavailable_reason"] = "interrupted before the final evaluation"
    return report


def _perf(r: ReportInputs) -> dict[str, Any]:
    """report.json ``perf``: steady-state throughput, step times, time to first step, memory, efficiency."""
    stats = r.stats
    steady_s = sum(r.timer.steady_ms) / 1e3
    perf = {
        "throughput_samples_per_s": _ratio(stats.steady_samples, steady_s),
        "throughput_tokens_per_s": _ratio(stats.steady_real_tokens, steady_s),
        "time_to_first_step_s": (stats.first_step_end - r.t_start) if stats.first_step_end else None,
        "first_step_ms": r.timer.first_ms,
        "step_time_ms": r.timer.summary(),
        "steps": stats.steps,
        "train_samples_seen": stats.samples,
        "wall_time_s": r.wall_s,
        **r.memory,
    }
    if r.cfg.model.task == "causal-lm":  # what a language model is trained on: the tokens that are targets
        perf["throughput_target_tokens_per_s"] = _ratio(stats.steady_target_tokens, steady_s)
        perf["train_target_tokens_seen"] = stats.target_tokens
    if stats.steps < 2:
        perf["throughput_unavailable_reason"] = "fewer than 2 steps: no steady-state steps after the first (cold) one"
    if r.data_prep_s is not None:
        perf["data_prep_s"] = r.data_prep_s
    perf.update(r.efficiency)
    return perf


def _quality(r: ReportInputs) -> dict[str, Any]:
    """report.json ``quality``: evaluation and test results, the majority-class baseline, why one is missing."""
    cfg, final_eval, test_eval = r.cfg, r.final_eval, r.test_eval
    test_labels = r.bundle.splits["test"].labels[:cfg.data.max_eval_samples]  # what was evaluated
    majority = float(np.bincount(test_labels).max() / len(test_labels)) if len(test_labels) else None
    quality = {
        "eval_accuracy": final_eval.get("accuracy"),
        "eval_macro_f1": final_eval.get("macro_f1"),
        "eval_loss": final_eval.get("loss"),
        "final_train_loss": r.stats.final_train_loss,
        "test_accuracy": test_eval.get("accuracy"),
        "test_macro_f1": test_eval.get("macro_f1"),
        "test_majority_class_accuracy": majority,
        "eval_samples": final_eval.get("samples"),
        "test_samples_evaluated": test_eval.get("samples"),
        "evals": r.stats.evals,
    }
    if cfg.model.task == "causal-lm":
        quality.update({"eval_perplexity": final_eval.get("perplexity"), "eval_target_tokens": final_eval.get(
            "target_tokens"), "test_loss": test_eval.get("loss"), "test_perplexity": test_eval.get("perplexity"),
            "test_majority_class_accuracy": None, "eval_macro_f1": None, "test_macro_f1": None})
    before = next((e for e in r.stats.evals if e.get("step") == 0), None)  # train.eval_before: the base's figures
    quality.update({f"eval_{k}_before": (before or {}).get(k) for k in ("loss", "accuracy", "perplexity")})
    if cfg.model.task == "causal-lm":
        quality["answers"] = r.stats.answers or None  # fixed prompts before / after (train/generate/answers.py)
    train_samples = len(r.bundle.splits["train"])
    for name, split, result in (("eval", "validation", final_eval), ("test", "test", test_eval)):
        if result and result.get("accuracy") is None:
            quality[f"{name}_unavailable_reason"] = (
                f"the {split} split is empty (data.{'val' if split == 'validation' else 'test'}_fraction="
                f"{cfg.data.val_fraction if split == 'validation' else cfg.data.test_fraction}, {train_samples} "
                "training examples): nothing to evaluate")
    return quality


def _data(cfg: RunConfig, bundle: DataBundle) -> dict[str, Any]:
    """report.json ``data``: the source, split sizes, labels, truncation, fingerprints, tokenizer and cache facts."""
    train_split = bundle.splits["train"]
    data = {
        "name": bundle.corpus.name,
        "source": cfg.data.source,
        "train_samples": len(train_split),
        "validation_samples": len(bundle.splits["validation"]),
        "test_samples": len(bundle.splits["test"]),
        "max_eval_samples": cfg.data.max_eval_samples,
        "num_classes": bundle.num_classes,
        "label_names": bundle.corpus.label_names,
        "truncated_samples": sum(s.truncated for s in bundle.splits.values()),
        "truncated_train_samples": train_split.truncated,
        "unk_only_words": _unk_only_words(bundle),
        "mean_train_length": float(train_split.lengths.mean()),
        "max_train_length": int(train_split.lengths.max()),
        "data_fingerprint": bundle.data_fingerprint,
        "tokenizer": bundle.tokenizer_info,
        "classes_without_training_examples": bundle.classes_without_training_examples,
        **bundle.cache,
        # blank lines a JSONL/CSV source skipped (null: data prepared before they were recorded)
        "blank_lines_skipped": bundle.data_facts.get("blank_lines_skipped"),
        "first_blank_line": bundle.data_facts.get("first_blank_line"),
    }
    if cfg.model.task == "causal-lm":  # every row dropped (by cause) and every text cut or split
        f = bundle.data_facts
        data.update({"on_bad_row": cfg.data.on_bad_row, "long_text": cfg.data.long_text,
                     "dropped_rows": f.get("dropped_rows", {}), "dropped_rows_first": f.get("dropped_rows_first", {}),
                     "truncated_tokens": f.get("truncated_tokens"),
                     "split_texts": f.get("split_texts"), "split_chunks": f.get("split_chunks")})
    return data


def _batching(r: ReportInputs) -> dict[str, Any]:
    """report.json ``batching``: the method, its buckets or packed rows, token efficiency, dropped and repeated
    samples, and ``batching.method=auto``'s decision."""
    cfg, bundle, stats = r.cfg, r.bundle, r.stats
    return {
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
        "dropped_samples": r.sampler_counts["dropped"],
        "repeated_samples": r.sampler_counts["repeated"],
        "truncated_in_collate": stats.truncated_in_collate,
        **_packing_fields(cfg, bundle, stats, r.packed_attention),
        **({"auto": r.batching_auto} if r.batching_auto else {}),
    }


def _packing_fields(cfg: RunConfig, bundle: DataBundle, stats: TrainStats,
                    attention: Optional[dict] = None) -> dict[str, Any]:
    """batching.* for ``batching.method=packed``: rows per step, samples per row, pack efficiency, and the attention
    path that ran (``attention``: the run's decision, train/data/attention.py; None: the model's default, sdpa-mask)."""
    if cfg.batching.method != "packed":
        return {}
    layout = pack_layout(cfg, bundle.splits["train"].lengths)
    rows = stats.padded_tokens / layout.capacity if layout.capacity else 0
    return {"pack_len": layout.capacity, "rows_per_step": layout.rows, "label_slots_per_step": layout.max_seqs,
            "samples_per_row": _ratio(stats.samples, rows),
            "pack_efficiency": _ratio(stats.real_tokens, stats.padded_tokens),
            "attention_path": attention["path"] if attention else "sdpa-mask",
            "attention_reason": attention["reason"] if attention else "the model's default (no decision was made)",
            "attention": attention}


def efficiency_fields(model: EncoderClassifier, stats: TrainStats, steady_s: float, energy: dict,
                      device: torch.device, precision: str) -> dict[str, Any]:
    """perf.mfu (+ both peaks) from FLOPs counted per steady-state step shape, and energy per step/sample/token."""
    step_flops, method = step_flops_for(model)  # any model: the built-in encoder by spec, others counted
    steady_flops = sum(step_flops(b, s) * n for (b, s), n in stats.steady_shape_counts.items())
    per_sample = (getattr(step_flops, "attention_for_pairs", lambda _p: None)(stats.steady_attention_pairs)
                  if stats.steady_attention_pairs else None)
    if per_sample is not None:  # varlen attention: what its kernels computed, sample by sample, not C² per row
        steady_flops = per_sample + sum(step_flops.without_attention(b, s) * n
                                        for (b, s), n in stats.steady_shape_counts.items())
        method += VARLEN_FLOPS_METHOD
    achieved = steady_flops / steady_s if steady_s > 0 and steady_flops else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"flops_per_step_mean": steady_flops / max(1, stats.steady_steps),
           "flops_method": method, **mfu_fields(achieved, device, name, precision)}
    out.update(per_unit(energy, stats.steps, stats.samples, stats.real_tokens))
    return out


def clip_report(cfg: RunConfig) -> dict[str, Any]:
    """report.json ``clip``: the method and its parameters."""
    c = cfg.clip
    params = {"global-norm": {"max_norm": c.max_norm}, "per-layer-std": {"std_k": c.std_k},
              "agc": {"agc_lambda": c.agc_lambda, "agc_eps": c.agc_eps}, "none": {}}[c.method]
    return {"method": c.method, **params}


def write_aborted_report(cfg: RunConfig, run_dir: Path, bundle: DataBundle, trainer: Trainer, abort: NumericsAbort,
                         device: torch.device, policy: PrecisionPolicy, t_start: float) -> None:
    """report.json for a run the numerics guard stopped: status ``aborted-numerics``, the diagnosis under
    ``numerics``, no evaluation, and throughput figures null (``perf.throughput_valid`` false)."""
    env = {**collect_env(device), **policy.report(), "num_threads": torch.get_num_threads()}
    counts = sampler_counts(trainer.train_loader, trainer.epoch + 1)
    report = build_report(ReportInputs(cfg, run_dir, bundle, trainer.stats, trainer.timer, {}, {}, env,
                                       peak_memory(device), counts, t_start, time.perf_counter() - t_start,
                                       sections={"numerics": {**abort.diagnosis, "aborted": True},
                                                 "clip": clip_report(cfg)}))
    report["status"] = "aborted-numerics"
    report["error"] = str(abort)
    perf = report["perf"]
    perf["throughput_valid"] = False
    for key in ("throughput_samples_per_s", "throughput_tokens_per_s"):
        perf[key] = None
    perf["throughput_unavailable_reason"] = "run aborted by the numerics guard: steps were skipped, not trained"
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2) + "\n")

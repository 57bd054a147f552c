"""Inference benchmark: the evaluation split answered as single requests and as batched requests.

A request is the whole path a caller waits for: tokenize → pad to the bucket bound (static
shapes) → forward → arg-max → label name. Figures: time to first response (model load + the
first, cold request, including any compilation), per-request latency p50/p90/p99 of the
following requests, requests/s, peak memory and energy per request (null + reason where
unmeasurable).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from train.checkpoint import load_checkpoint
from train.config import RunConfig
from train.data import DataBundle
from train.data.collate import PadCollate
from train.data.tokenizer import encode
from train.errors import UserError
from train.model import EncoderClassifier, EncoderSpec
from train.perf.energy import EnergyMeter, per_unit
from train.perf.memory import WindowPeakMemory
from train.perf.timer import Timed, percentiles
from train.precision import PrecisionPolicy
from train.setup import build_model
from train.tools.progress import progress_bar


class Classifier:
    """Answers text requests with label names: ``Classifier(...)(texts) -> list[str]``."""

    def __init__(self, model: EncoderClassifier, tokenizer: Tokenizer, bundle: DataBundle, label_names: list[str],
                 policy: PrecisionPolicy, device: torch.device, max_len: int) -> None:
        self.model, self.tokenizer, self.policy, self.device = model.eval(), tokenizer, policy, device
        self.label_names, self.max_len = label_names, max_len
        self.collate = PadCollate(bundle.pad_id, bundle.bounds, "bound")

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> list[str]:
        split = encode(self.tokenizer, texts, np.zeros(len(texts), dtype=np.int64), self.max_len)
        batch = self.collate([(ids, 0) for ids in split.ids])
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        mask = batch["attention_mask"].to(self.device, non_blocking=True)
        logits = self.model(ids, mask, self.policy.blocks_autocast)
        return [self.label_names[i] for i in logits.argmax(-1).tolist()]  # .tolist(): sync point


def load_model(cfg: RunConfig, bundle: DataBundle, device: torch.device,
               checkpoint: Optional[str]) -> tuple[EncoderClassifier, list[str], str]:
    """The model to serve: from ``checkpoint`` (state_dict + spec) or freshly initialised.

    Raises:
        UserError: the checkpoint's vocabulary/classes do not match this config's data and tokenizer.
    """
    if checkpoint is None:
        return build_model(cfg, bundle).to(device), list(bundle.corpus.label_names), "freshly initialised (no bench.checkpoint)"
    state = load_checkpoint(checkpoint)
    spec = EncoderSpec(**state["spec"])
    if spec.vocab_size != bundle.vocab_size or spec.num_classes != bundle.num_classes:
        raise UserError(f"checkpoint {checkpoint} was trained with vocab {spec.vocab_size} / {spec.num_classes} classes, "
                        f"this config gives {bundle.vocab_size} / {bundle.num_classes}; pass that run's config "
                        "(--config runs/<id>/config.yaml)")
    model = EncoderClassifier(spec)
    model.load_state_dict(state["model"])
    return model.to(device), list(state.get("label_names") or bundle.corpus.label_names), checkpoint


def _measure(answer: Callable[[list[str]], list[str]], groups: list[list[str]], device: torch.device,
             done: Callable[[int], Any] = lambda _n: None) -> dict[str, Any]:
    """Answer ``groups`` one call each; ``done(n)`` after each call's timing (``n`` requests answered)."""
    memory, meter = WindowPeakMemory(device), EnergyMeter(device)
    memory.start()
    meter.start()
    latencies: list[float] = []
    t_all = time.perf_counter()
    for group in groups:
        with Timed(device) as t:
            answer(group)
        latencies.append(t.ms)
        done(len(group))
    total_s = time.perf_counter() - t_all
    energy = meter.stop()
    requests = sum(len(g) for g in groups)
    out: dict[str, Any] = {"requests": requests, "calls": len(groups), "latency_ms": percentiles(latencies),
                           "requests_per_s": requests / total_s if total_s else None, **memory.stop()}
    unit = per_unit(energy, len(groups), requests, 0)
    out["energy_j"] = unit["energy_j"]
    out["energy_j_per_request"] = unit["energy_j_per_sample"]
    if unit["energy_j"] is None:
        out["energy_unavailable_reason"] = unit["energy_unavailable_reason"]
    out["latencies_ms"] = latencies
    return out


def run_inference_bench(cfg: RunConfig, bundle: DataBundle, tokenizer: Tokenizer, device: torch.device,
                        notice: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve ``bench.requests`` validation texts one by one, then in batches of ``bench.inference_batch_size``
    (the model from ``bench.checkpoint``, or a fresh one)."""
    num_requests, batch_size = cfg.bench.requests, cfg.bench.inference_batch_size
    split = bundle.corpus.validation if len(bundle.corpus.validation) else bundle.corpus.train
    texts = [split.texts[i % len(split)] for i in range(num_requests + 1)]
    truth = [bundle.corpus.label_names[int(split.labels[i % len(split)])] for i in range(num_requests + 1)]
    t0 = time.perf_counter()
    model, label_names, source = load_model(cfg, bundle, device, cfg.bench.checkpoint)
    policy = PrecisionPolicy.for_config(cfg, device)
    clf = Classifier(model, tokenizer, bundle, label_names, policy, device, cfg.data.max_len)
    with Timed(device) as t:
        first = clf(texts[:1])
    t_first, t_done = t.start, t.end
    notice(f"bench: inference model {source}; first response after {t_done - t0:.2f} s")
    with progress_bar(2 * num_requests, "bench inference", cfg.train.progress, unit="request") as bar:
        single = _measure(clf, [[t] for t in texts[1:]], device, bar.update)
        batched = _measure(clf, [texts[1 + i : 1 + i + batch_size] for i in range(0, num_requests, batch_size)], device,
                           bar.update)
    answers = clf(texts[1:])
    return {
        "model": source,
        "precision": policy.mode,
        "time_to_first_response_s": t_done - t0,
        "first_request_ms": (t_done - t_first) * 1e3,
        "first_answer": first[0],
        "accuracy_on_requests": float(np.mean([a == b for a, b in zip(answers, truth[1:])])),
        "single": single,
        "batched": {**batched, "batch_size": batch_size},
    }

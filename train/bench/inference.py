"""Inference benchmark: the evaluation split answered as single requests, as batched requests, and under an
open-loop load.

A request is the whole path a caller waits for: tokenize → batch → forward → arg-max → label name. A call's
requests share forwards in one of two ways (``bench.inference_batching``):

* ``packed`` (the default for models that support packing): the requests are packed back to back into rows
  (least-slack rows, :func:`~train.data.packing.pack_rows`) as long as the bucket bound of the call's longest
  request, positions restarting per request and attention block-diagonal, so each request's logits are its
  unpacked logits — **one forward per call**, almost no padding. A single request is one row of its bucket bound.
* ``bucket``: **grouped by length**, one forward per bucket present, each padded to its bound (static shapes),
  so a short request is never padded to the longest one's bound — but a call of 32 mixed requests makes
  several small forwards.

* ``single``: one request per call; ``batched``: ``bench.inference_batch_size`` requests per call (closed loop:
  its requests/s is the measured maximum rate).
* ``load``: open loop, as an inference server sees it: Poisson arrivals at 25/50/90 % of that maximum rate, a
  dynamic batcher that serves the queue when it holds a full batch or its oldest request has waited
  ``bench.max_queue_delay_ms`` (Triton's / TorchServe's ``max_queue_delay``), latency = completion − arrival
  (queueing included); achieved requests/s and p50/p99 latency per level.

Figures also: time to first response (model load + the first, cold request, including any compilation),
peak memory and energy per request (null + reason where unmeasurable).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from train.config import RunConfig
from train.data import DataBundle
from train.data.buckets import assign_buckets
from train.data.collate import PadCollate
from train.data.packing import PackCollate, pack_rows, packed_forward
from train.data.tokenizer import encode
from train.errors import UserError
from train.models.encoder import EncoderClassifier, EncoderSpec
from train.parallel.sharded_checkpoint import load_any
from train.perf.energy import EnergyMeter, per_unit
from train.perf.memory import WindowPeakMemory
from train.perf.timer import Timed, percentiles
from train.precision import PrecisionPolicy
from train.setup import build_model
from train.tools.progress import progress_bar

LOAD_LEVELS = (0.25, 0.5, 0.9)
"""Open-loop offered load as shares of the measured maximum (closed-loop batched) rate."""


class Classifier:
    """Answers text requests with label names: ``Classifier(...)(texts) -> list[str]``."""

    def __init__(self, model: EncoderClassifier, tokenizer: Tokenizer, bundle: DataBundle, label_names: list[str],
                 policy: PrecisionPolicy, device: torch.device, max_len: int, batching: str = "auto") -> None:
        """``batching``: ``packed`` | ``bucket`` | ``auto`` (``packed`` when ``model.supports_packing``).

        Raises:
            UserError: ``packed`` asked for a model that cannot run packed rows.
        """
        self.model, self.tokenizer, self.policy, self.device = model.eval(), tokenizer, policy, device
        self.label_names, self.max_len = label_names, max_len
        self.collate = PadCollate(bundle.pad_id, bundle.bounds, "bound")
        self.pad_id = bundle.pad_id
        can_pack = bool(getattr(model, "supports_packing", False))
        if batching == "packed" and not can_pack:
            raise UserError(f"bench.inference_batching=packed: the model {type(model).__name__} cannot run packed rows "
                            "(supports_packing is false); use bench.inference_batching=bucket or auto")
        self.batching = "packed" if batching == "packed" or (batching == "auto" and can_pack) else "bucket"

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> list[str]:
        """Label names for ``texts``, in order: one packed forward (``packed``), or one forward per bucket present."""
        split = encode(self.tokenizer, texts, np.zeros(len(texts), dtype=np.int64), self.max_len)
        bucket = assign_buckets(split.lengths, self.collate.bounds)
        answers: list[str] = [""] * len(texts)
        if self.batching == "packed":
            capacity = int(self.collate.bounds[int(bucket.max())])  # the longest request's bound: 1 request = 1 row
            rows = pack_rows(split.lengths, capacity)
            batch = PackCollate(self.pad_id, capacity, len(rows))([[(split.ids[i], 0) for i in row] for row in rows])
            logits = packed_forward(self.model, batch["input_ids"].to(self.device, non_blocking=True),
                                    batch["position_ids"].to(self.device, non_blocking=True),
                                    batch["seq_index"].to(self.device, non_blocking=True), batch["samples"],
                                    self.policy.blocks_autocast)
            members = [i for row in rows for i in row]  # the collate numbers samples row by row
            for i, label in zip(members, logits.argmax(-1).tolist()):  # .tolist(): sync point
                answers[i] = self.label_names[label]
            return answers
        for k in np.unique(bucket).tolist():
            members = np.flatnonzero(bucket == k).tolist()
            batch = self.collate([(split.ids[i], 0) for i in members])
            ids = batch["input_ids"].to(self.device, non_blocking=True)
            mask = batch["attention_mask"].to(self.device, non_blocking=True)
            logits = self.model(ids, mask, self.policy.blocks_autocast)
            for i, label in zip(members, logits.argmax(-1).tolist()):  # .tolist(): sync point
                answers[i] = self.label_names[label]
        return answers


def load_model(cfg: RunConfig, bundle: DataBundle, device: torch.device,
               checkpoint: Optional[str]) -> tuple[EncoderClassifier, list[str], str]:
    """The model to serve: from ``checkpoint`` (state_dict + spec) or freshly initialised.

    Raises:
        UserError: the checkpoint's vocabulary/classes do not match this config's data and tokenizer.
    """
    if checkpoint is None:
        return (build_model(cfg, bundle).to(device), list(bundle.corpus.label_names),
                "freshly initialised (no bench.checkpoint)")
    state = load_any(checkpoint)
    spec = state["spec"]
    if spec["vocab_size"] != bundle.vocab_size or spec["num_classes"] != bundle.num_classes:
        raise UserError(f"checkpoint {checkpoint} was trained with vocab {spec['vocab_size']} / {spec['num_classes']} "
                        f"classes, this config gives {bundle.vocab_size} / {bundle.num_classes}; "
                        "pass that run's config (--config runs/<id>/config.yaml)")
    # a model from model.source (train/models) is rebuilt from the run's config (+ the checkpoint's HF config)
    model = (build_model(cfg, bundle, spec.get("hf_config") or None) if "source" in spec
             else EncoderClassifier(EncoderSpec(**spec)))
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


def open_loop(answer: Callable[[list[str]], list[str]], texts: list[str], rate: float, max_batch: int,
              max_delay_s: float, seed: int = 0) -> dict[str, Any]:
    """Serve ``texts`` arriving as a Poisson process of ``rate`` requests/s (seeded) with a dynamic batcher: a batch
    (at most ``max_batch``) starts when the queue holds a full batch, its oldest request has waited ``max_delay_s``,
    or no more requests will come. Returns achieved requests/s, latency percentiles (ms, queueing included) and
    the mean batch size."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(texts)))
    latency = np.zeros(len(texts))
    queue: list[int] = []
    nxt, sizes = 0, []
    t0 = time.perf_counter()
    while nxt < len(texts) or queue:
        now = time.perf_counter() - t0
        while nxt < len(texts) and arrivals[nxt] <= now:
            queue.append(nxt)
            nxt += 1
        due = queue and (len(queue) >= max_batch or now - arrivals[queue[0]] >= max_delay_s or nxt == len(texts))
        if not due:
            wake = min(arrivals[queue[0]] + max_delay_s if queue else np.inf,
                       arrivals[nxt] if nxt < len(texts) else np.inf)
            time.sleep(max(0.0, wake - now))
            continue
        batch, queue = queue[:max_batch], queue[max_batch:]
        answer([texts[i] for i in batch])
        done = time.perf_counter() - t0
        latency[batch] = done - arrivals[batch]
        sizes.append(len(batch))
    span = float((arrivals + latency).max() - arrivals[0])  # first arrival → last completion
    return {"offered_requests_per_s": rate, "achieved_requests_per_s": len(texts) / span if span > 0 else None,
            "latency_ms": percentiles((latency * 1e3).tolist()), "mean_batch_size": float(np.mean(sizes)),
            "requests": len(texts)}


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
    clf = Classifier(model, tokenizer, bundle, label_names, policy, device, cfg.data.max_len,
                     cfg.bench.inference_batching)
    with Timed(device) as t:
        first = clf(texts[:1])
    t_first, t_done = t.start, t.end
    notice(f"bench: inference model {source}; first response after {t_done - t0:.2f} s")
    with progress_bar(2 * num_requests, "bench inference", cfg.train.progress, unit="request") as bar:
        single = _measure(clf, [[t] for t in texts[1:]], device, bar.update)
        batched = _measure(clf, [texts[1 + i : 1 + i + batch_size] for i in range(0, num_requests, batch_size)], device,
                           bar.update)
    answers = clf(texts[1:])
    peak = batched["requests_per_s"]
    delay = cfg.bench.max_queue_delay_ms / 1e3
    load = [{"load": share, **open_loop(clf, texts[1:], share * peak, batch_size, delay, seed=cfg.train.seed)}
            for share in LOAD_LEVELS] if peak else []
    for level in load:
        notice(f"bench: inference at {level['load']:.0%} load: {level['achieved_requests_per_s']:.0f} requests/s, "
               f"p50 {level['latency_ms']['p50']:.1f} ms, p99 {level['latency_ms']['p99']:.1f} ms")
    return {
        "model": source,
        "precision": policy.mode,
        "time_to_first_response_s": t_done - t0,
        "first_request_ms": (t_done - t_first) * 1e3,
        "first_answer": first[0],
        "accuracy_on_requests": float(np.mean([a == b for a, b in zip(answers, truth[1:])])),
        "single": single,
        "batched": {**batched, "batch_size": batch_size, "batching": clf.batching,
                    "grouped_by": "packed rows (one forward per call)" if clf.batching == "packed"
                    else "bucket (one forward per bucket present)"},
        "batched_vs_single_requests_per_s": (peak / single["requests_per_s"]
                                             if peak and single["requests_per_s"] else None),
        "load": load,
        "load_settings": {"arrivals": "Poisson", "levels_of_max_rate": list(LOAD_LEVELS),
                          "max_rate_requests_per_s": peak, "max_batch": batch_size,
                          "max_queue_delay_ms": cfg.bench.max_queue_delay_ms},
    }

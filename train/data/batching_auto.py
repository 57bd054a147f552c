"""``batching.method=auto``: packed rows or optimal buckets, whichever trains more samples/s on this device,
model and data — measured, cached, and said.

The measurement times the run's own training step (:meth:`~train.trainer.Trainer.step` of a throwaway trainer; the
model, GradScaler and RNGs are restored after) on real training batches in the run's precision, through the one A/B
primitive (one untimed step per shape, then rotated rounds):

* **buckets** (``optimal``, the run's ``num_buckets`` / ``max_tokens`` / ``batch_size``): one full batch per bucket,
  each timed ``repeats`` times (median), weighted by the number of batches that bucket gives per epoch, so the
  figure is the epoch's expected samples/s, not that of a few randomly drawn shapes;
* **packed** (``pack_len`` / ``pack_rows`` / ``pack_window`` as the run would use): the first ``repeats`` + 1 batches
  of the run's own :class:`~train.data.packing.PackedBatchSampler` (rows shuffled after packing, as in training).

``packed`` is chosen when its samples/s is at least :data:`PACKED_MARGIN` × the buckets'. A model that cannot run
packed rows (``supports_packing`` false: the Hugging Face / ``python:`` wrappers) gets ``optimal`` by rule, with
no measurement. The RNG state is restored afterwards, so the run's dropout stream is that of the chosen method.
The decision is cached under ``data.cache_dir/decisions/`` per device, torch version and threads, model shape,
precision, data fingerprint and batching settings; a busy machine (load average above its cores) measures but does
not cache. Same pattern as ``precision=auto`` (train/precision.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from train.config import RunConfig
from train.data.bundle import DataBundle, bucket_plan
from train.data.causal_collate import pack_collate_for, pad_collate_for
from train.data.loaders import pack_layout
from train.data.packing import PackedBatchSampler
from train.data.sampler import BucketBatchSampler
from train.perf.ab import Arm, bootstrap_interval, interleave
from train.precision import PrecisionPolicy
from train.tools import decisions
from train.tools.env import machine_load

PACKED_MARGIN = 1.0
"""``auto`` picks packed rows when their measured samples/s ≥ this × the buckets' (ties go to packing: one shape)."""
DECISION_FORMAT = 2


@dataclass
class BatchingDecision:
    """The resolved method (``packed`` | ``optimal``), one-sentence ``reason``, ``source`` (rule|measured|cached) and
    the ``measurement`` behind a measured/cached one (samples/s, token efficiency and step ms per layout)."""

    method: str
    reason: str
    source: str
    measurement: Optional[dict[str, Any]] = None
    cache_path: Optional[str] = None

    def as_report(self) -> dict[str, Any]:
        return {"requested": "auto", "chosen": self.method, "reason": self.reason, "source": self.source,
                "measurement": self.measurement, "cache_path": self.cache_path}


def measure_layouts(step: Callable[[dict], Any], cfg: RunConfig, bundle: DataBundle, bounds: list[int],
                    device: torch.device, repeats: int = 2) -> dict[str, Any]:
    """Expected training samples/s of optimal buckets (``bounds``) and of packed rows for this model and data.

    ``step(batch)`` is the run's own training step (:meth:`~train.trainer.Trainer.step` of a probe trainer, whose
    caller restores the model afterwards). Every layout's shape is one arm of the A/B primitive
    (:func:`train.perf.ab.interleave`: one untimed step each, then ``repeats`` rotated rounds).

    Returns ``{"buckets": {...}, "packed": {...}, "ratio": packed ÷ buckets samples/s, "ratio_interval": [low,
    high], "repeats": int}``; each layout has ``samples_per_s``, ``token_efficiency`` (real ÷ processed tokens) and
    ``step_ms`` (per shape, median, milliseconds). Raises ValueError on an empty training split.
    """
    b, lengths = cfg.batching, bundle.splits["train"].lengths
    if len(lengths) == 0:
        raise ValueError("no training samples to measure")
    ids_of = bundle.splits["train"].ids
    sampler = BucketBatchSampler(lengths, bounds, batch_size=b.batch_size, max_tokens=b.max_tokens,
                                 round_batch_to=8 if b.round_to % 8 == 0 else 1)
    collate = pad_collate_for(bundle.task, bundle.pad_id, bounds, "bound")
    bucket_batches: list[tuple[dict, int]] = []  # (a full batch of the bucket, batches per epoch)
    for k, size in enumerate(sampler.batch_sizes):
        members = np.flatnonzero(sampler.bucket_of == k)
        if len(members):
            bucket_batches.append((collate([(ids_of[i], 0) for i in members[:size].tolist()]),
                                   math.ceil(len(members) / size)))
    layout = pack_layout(cfg, lengths)
    pack = pack_collate_for(bundle.task, bundle.pad_id, layout.capacity, layout.rows, layout.max_seqs)
    packed_batches = [pack.collate_items([(r, ids_of[i], 0) for r, i in batch]) for batch in itertools.islice(
        PackedBatchSampler(lengths, layout.capacity, layout.rows, seed=cfg.train.seed, window=b.pack_window),
        repeats + 1)]
    used = packed_batches[1:] or packed_batches
    packed_calls = itertools.count()

    def packed_step() -> None:  # the first (untimed) call on batch 0, then the others in turn
        i = next(packed_calls)
        step(packed_batches[0] if i == 0 else used[(i - 1) % len(used)])

    arms = [Arm(f"bucket-{k}", functools.partial(step, bt))
            for k, (bt, _) in enumerate(bucket_batches)] + [Arm("packed", packed_step)]
    ab = interleave(arms, rounds=repeats, window=1, warmup=1, device=device)
    n = [count for _, count in bucket_batches]
    samples = sum(c * bt["samples"] for c, (bt, _) in zip(n, bucket_batches))
    real = sum(c * bt["real_tokens"] for c, (bt, _) in zip(n, bucket_batches))
    padded = sum(c * bt["input_ids"].numel() for c, (bt, _) in zip(n, bucket_batches))
    p_samples = sum(bt["samples"] for bt in used) / len(used)
    # per round: the epoch's expected time with buckets (each shape weighted by its batches) vs packed rows
    per_round = []
    for r in range(repeats):
        epoch_s = sum(c * ab.arms[f"bucket-{k}"].windows[r].seconds for k, c in enumerate(n))
        per_round.append((p_samples / ab.arms["packed"].windows[r].seconds) / (samples / epoch_s))
    med = [ab.arms[f"bucket-{k}"].median_step_ms() for k in range(len(bucket_batches))]
    buckets_sps = samples / (sum(c * m for c, m in zip(n, med)) / 1e3)
    packed_ms = ab.arms["packed"].median_step_ms()
    packed_sps = p_samples / (packed_ms / 1e3)
    return {"buckets": {"samples_per_s": buckets_sps, "token_efficiency": real / padded, "bounds": list(bounds),
                        "step_ms": {f"{bt['input_ids'].shape[0]}x{bt['input_ids'].shape[1]}": m
                                    for (bt, _), m in zip(bucket_batches, med)}},
            "packed": {"samples_per_s": packed_sps,
                       "token_efficiency": float(np.mean([bt["real_tokens"] / bt["input_ids"].numel() for bt in used])),
                       "step_ms": {f"{layout.rows}x{layout.capacity}": packed_ms}},
            "ratio": packed_sps / buckets_sps, "ratio_interval": list(bootstrap_interval(per_round)),
            "repeats": repeats, "load_1min_start": ab.load_start, "load_1min_end": ab.load_end}


def _fingerprint(model: torch.nn.Module, policy: PrecisionPolicy, cfg: RunConfig, bundle: DataBundle,
                 device: torch.device) -> dict[str, Any]:
    b = cfg.batching
    return {**decisions.machine_identity(device),
            "model": [type(model).__name__, sum(p.numel() for p in model.parameters()),
                      str(getattr(model, "spec", ""))], "precision": policy.mode, "data": bundle.data_fingerprint,
            "batching": [b.num_buckets, b.max_tokens, b.batch_size, b.round_to, b.pack_len, b.pack_rows, b.pack_window,
                         cfg.data.max_len, cfg.train.seed]}


def choose_batching(model: torch.nn.Module, policy: PrecisionPolicy, cfg: RunConfig, bundle: DataBundle,
                    device: torch.device, probe: Callable[[], ContextManager[Callable[[dict], Any]]],
                    measure: Optional[Callable[..., dict[str, Any]]] = None) -> BatchingDecision:
    """Resolve ``batching.method=auto`` for this run (see the module docstring). ``bundle`` holds the optimal
    bucket plan (what ``auto`` plans before the model exists). ``probe()``: a context manager giving the run's
    training step (``step(batch)``) for the measurement and restoring the model after it
    (:func:`train.setup.probe_steps`); entered only when a measurement runs. ``measure``: :func:`measure_layouts`
    when None (tests force its result)."""
    if not getattr(model, "supports_packing", False):
        return BatchingDecision("optimal", f"auto: the model {type(model).__name__} cannot run packed rows "
                                           "(supports_packing is false): optimal buckets by rule", "rule")
    fp = _fingerprint(model, policy, cfg, bundle, device)
    path = decisions.cache_path(cfg.data.cache_dir, "batching", fp, DECISION_FORMAT)
    cached = decisions.read_cached(path, fp, "method", ("packed", "optimal"))
    if cached is not None:
        return BatchingDecision(cached["method"], cached["reason"], "cached", cached["measurement"], path)
    load = machine_load()
    with probe() as step:
        m = (measure or measure_layouts)(step, cfg, bundle, list(bundle.bounds), device)
    method = "packed" if m["ratio"] >= PACKED_MARGIN else "optimal"
    pk, bk = m["packed"], m["buckets"]
    reason = (f"auto: packed rows trained {m['ratio']:.2f}x the samples/s of optimal buckets on this device and data "
              f"(packed {pk['samples_per_s']:.0f} samples/s at token efficiency {pk['token_efficiency']:.3f}, "
              f"{len(bk['bounds'])} buckets {bk['samples_per_s']:.0f} at {bk['token_efficiency']:.3f}; training steps, "
              f"median of {m['repeats']} per shape, {policy.mode}): {method}")
    decision = BatchingDecision(method, reason + decisions.busy_note(load), "measured", m)
    decision.cache_path = decisions.store(path, {"method": method, "reason": reason, "measurement": m,
                                                 "fingerprint": fp}, load)
    return decision


def apply_batching(cfg: RunConfig, bundle: DataBundle, method: str) -> tuple[RunConfig, DataBundle]:
    """The run's config with ``batching.method`` = the resolved ``method`` (a new config: the loaded one is left as it
    is) and the bundle planned for it (the packed layout's bounds and evaluation padding when ``packed``; the optimal
    plan already in ``bundle`` otherwise)."""
    cfg = cfg.with_values({"batching.method": method}, "batching.method=auto")
    if method != "packed":
        return cfg, bundle
    bounds, pad_to, plan, source = bucket_plan(cfg, bundle.splits["train"].lengths, bundle.data_fingerprint,
                                               bundle.tokenizer_info["fingerprint"], None, False, lambda _m: None)
    return cfg, replace(bundle, bounds=bounds, pad_to=pad_to, plan=plan, plan_source=source)

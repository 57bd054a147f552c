"""``python -m train bench-batching``: batching methods side by side, in one process, on the same data.

Every method forms one epoch of batches over the same training split; the same model (a fresh
``model.preset``, default ``tiny``) then runs real training steps (forward, cross-entropy,
backward, clipping, AdamW) on batches drawn from each method's epoch plan. The methods:

* ``pad-to-max`` — random batches padded to ``data.max_len``;
* ``random-pad-to-batch-max`` — the same random batches padded to the longest sample in each;
* ``hf-group-by-length`` — Hugging Face's megabatch grouping (:mod:`train.data.grouping`), pad to batch max;
* ``kmeans-5`` — the original design: 1-D k-means bounds, 5 buckets, pad to the bound;
* ``optimal-<K>`` — the minimum-padding DP bounds (K buckets), pad to the bound;
* ``optimal-<K>-max-tokens`` — the same bounds with a token budget per batch (fairseq ``--max-tokens``);
* ``optimal-<K>-batch-max`` — the same batches as ``optimal-<K>`` padded to the batch max (more shapes);
* ``packed-<C>`` — sequence packing (:mod:`train.data.packing`): samples back to back in rows of
  C = ``data.max_len`` tokens with a block-diagonal mask, ⌊max_tokens / C⌋ rows per batch (one shape).

Token efficiency and distinct shapes are exact, over each method's whole epoch. Throughput is
measured in timed windows of about ``bench_batching.window_samples`` samples each: after
``bench_batching.warmup_windows`` rounds, ``bench_batching.windows`` rounds each run every method
once, the order rotated per round so machine noise hits every method alike; a method's samples/s
and tokens/s (real tokens, padding not counted) are the medians over its windows. A window draws
batches uniformly from the method's shuffled epoch plan, so it costs what an average stretch of
that epoch costs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.config import RunConfig
from train.config.bench import BenchBatchingConfig
from train.data.buckets import fit_boundaries, token_efficiency
from train.data.collate import PadCollate, TokenDataset
from train.data.grouping import length_grouped_batches
from train.data.packing import PackCollate, packed_batches
from train.data.sampler import BucketBatchSampler
from train.errors import UserError
from train.perf.ab import Arm, interleave
from train.tools.progress import beside, progress_bar

BASELINE = "pad-to-max"


@dataclass
class Method:
    """One batching method: its whole-epoch batch plan and how batches are padded."""

    name: str
    description: str
    bounds: list[int]
    pad_to: str
    batches: list
    """Lists of sample indices; for a packed method, lists of rows (lists of sample indices)."""
    packed: bool = False


def build_methods(lengths: np.ndarray, max_len: int, bc: BenchBatchingConfig, seed: int) -> list[Method]:
    """The benchmark's rows (in report order), each with one epoch's batches over ``lengths``."""
    k = bc.num_buckets

    def plan(bounds: list[int], **kw: Any) -> list[list[int]]:
        return list(BucketBatchSampler(lengths, bounds, seed=seed, **kw))

    random_batches = plan([max_len], batch_size=bc.batch_size)
    kmeans = fit_boundaries(lengths, 5, "kmeans", max_len=max_len)
    optimal = fit_boundaries(lengths, k, "optimal", max_len=max_len)
    optimal_batches = plan(optimal, batch_size=bc.batch_size)
    return [
        Method(BASELINE, f"random batches of {bc.batch_size}, padded to data.max_len={max_len}", [max_len], "bound",
               random_batches),
        Method("random-pad-to-batch-max", "the same random batches, padded to the batch max", [max_len], "batch-max",
               random_batches),
        Method("hf-group-by-length", "transformers get_length_grouped_indices (megabatches of 50×batch, sorted "
               "longest first), padded to the batch max", [max_len], "batch-max",
               length_grouped_batches(lengths, bc.batch_size, seed=seed)),
        Method("kmeans-5", "1-D k-means bounds, 5 buckets, padded to the bucket bound", kmeans, "bound",
               plan(kmeans, batch_size=bc.batch_size)),
        Method(f"optimal-{k}", f"minimum-padding DP bounds, {k} buckets, padded to the bucket bound", optimal, "bound",
               optimal_batches),
        Method(f"optimal-{k}-max-tokens", f"the same bounds, batch = floor({bc.max_tokens} / bound) samples", optimal,
               "bound", plan(optimal, max_tokens=bc.max_tokens)),
        Method(f"optimal-{k}-batch-max", f"the same batches as optimal-{k}, padded to the batch max (dynamic shapes)",
               optimal, "batch-max", optimal_batches),
        Method(f"packed-{max_len}", f"sequence packing into rows of {max_len} tokens (block-diagonal attention), "
               f"{max(1, bc.max_tokens // max_len)} rows per batch", [max_len], "bound",
               packed_batches(lengths, max_len, max(1, bc.max_tokens // max_len), seed=seed), packed=True),
    ]


def epoch_stats(method: Method, lengths: np.ndarray) -> dict[str, Any]:
    """Exact whole-epoch figures of a plan: what a full epoch would process, without running it."""
    if method.packed:
        rows_per_batch = max(len(b) for b in method.batches)
        n = sum(len(r) for b in method.batches for r in b)
        real = int(np.minimum(lengths, method.bounds[0]).sum())
        padded = len(method.batches) * rows_per_batch * method.bounds[0]
        return {"token_efficiency": real / padded, "distinct_shapes": 1, "distinct_batch_shapes": 1,
                "batches_per_epoch": len(method.batches), "samples_per_epoch": n,
                "mean_batch_size": n / len(method.batches),
                "real_tokens_per_epoch": real, "padded_tokens_per_epoch": padded}
    collate = PadCollate(0, method.bounds, method.pad_to)
    real = padded = 0
    seq_lens: set[int] = set()
    batch_shapes: set[tuple[int, int]] = set()
    for batch in method.batches:
        lens = lengths[batch]
        s = collate.target_length(int(lens.max()))
        real += int(np.minimum(lens, s).sum())
        padded += len(batch) * s
        seq_lens.add(s)
        batch_shapes.add((len(batch), s))
    n = sum(len(b) for b in method.batches)
    return {"token_efficiency": real / padded, "distinct_shapes": len(seq_lens),
            "distinct_batch_shapes": len(batch_shapes), "batches_per_epoch": len(method.batches),
            "samples_per_epoch": n, "mean_batch_size": n / len(method.batches),
            "real_tokens_per_epoch": real, "padded_tokens_per_epoch": padded}


def _stream(batches: list[list[int]], rng: np.random.Generator) -> Iterator[list[int]]:
    """Batches of a plan in random order, reshuffled at every pass (uniform draws over the epoch)."""
    while True:
        for i in rng.permutation(len(batches)):
            yield batches[i]


def time_methods(methods: list[Method], dataset: TokenDataset, pad_id: int, step: Callable[[dict], Any],
                 bc: BenchBatchingConfig, device: torch.device, seed: int,
                 notice: Callable[[str], None] = print, bar: bool = False) -> dict[str, list[dict]]:
    """Interleaved timed windows through the one A/B primitive (:func:`train.perf.ab.interleave`: ``warmup_windows``
    untimed windows, then ``windows`` rounds, the order rotated per round). ``step(batch)`` is one training step
    (:meth:`~train.trainer.Trainer.step`). Returns ``{name: [{"samples", "real_tokens", "padded_tokens", "seconds"},
    …]}``. ``bar``: ask for a progress bar (one tick per round; drawn on a terminal only).

    A window's time covers collate, host→device copy and the training steps, between two device
    synchronisations (as the trainer's step time includes waiting for the batch).
    """
    rng = np.random.default_rng(seed)
    streams = {m.name: _stream(m.batches, rng) for m in methods}
    collates = {m.name: PackCollate(pad_id, m.bounds[0], max(len(b) for b in m.batches)) if m.packed
                else PadCollate(pad_id, m.bounds, m.pad_to) for m in methods}

    def arm(m: Method) -> Arm:
        def one() -> dict[str, float]:
            idx = next(streams[m.name])
            batch = collates[m.name]([[dataset[i] for i in row] for row in idx] if m.packed
                                     else [dataset[i] for i in idx])
            return step(batch).counts()

        return Arm(m.name, one)

    arms = [arm(m) for m in methods]
    with progress_bar(bc.warmup_windows + bc.windows, "bench-batching", bar, unit="round") as pbar:
        say = beside(pbar, notice)
        for r in range(bc.warmup_windows):  # untimed windows of every method, in turn
            interleave(arms, rounds=1, window_samples=bc.window_samples, warmup=0, device=device)
            pbar.update(1)
            say(f"bench-batching: round {r + 1}/{bc.warmup_windows + bc.windows} (warm-up) done")

        def done(r: int) -> None:
            pbar.update(1)
            say(f"bench-batching: round {bc.warmup_windows + r + 1}/{bc.warmup_windows + bc.windows} (timed) done")

        result = interleave(arms, rounds=bc.windows, window_samples=bc.window_samples, warmup=0, device=device,
                            on_round=done)
    return {m.name: [{**{k: w.counts.get(k, 0) for k in ("samples", "real_tokens", "padded_tokens")},
                      "seconds": w.seconds} for w in result.arms[m.name].windows] for m in methods}


def summarize(methods: list[Method], stats: dict[str, dict], windows: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """The ``results`` rows: exact epoch figures + median throughput + ratios to ``pad-to-max``."""
    rows = []
    for m in methods:
        ws = windows[m.name]
        sps = [w["samples"] / w["seconds"] for w in ws]
        tps = [w["real_tokens"] / w["seconds"] for w in ws]
        rows.append({"name": m.name, "description": m.description, "bounds": m.bounds, "pad_to": m.pad_to,
                     **stats[m.name],
                     "samples_per_s": float(np.median(sps)), "tokens_per_s": float(np.median(tps)),
                     "padded_tokens_per_s": float(np.median([w["padded_tokens"] / w["seconds"] for w in ws])),
                     "samples_per_s_windows": sps, "timed_samples": sum(w["samples"] for w in ws),
                     "timed_seconds": sum(w["seconds"] for w in ws)})
    base = next(r for r in rows if r["name"] == BASELINE)
    for r in rows:
        r["samples_per_s_vs_pad_to_max"] = r["samples_per_s"] / base["samples_per_s"]
        r["tokens_per_s_vs_pad_to_max"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["token_efficiency_vs_pad_to_max"] = r["token_efficiency"] / base["token_efficiency"]
    return rows


def dp_table(lengths: np.ndarray, max_len: int, k_max: int, target: float) -> dict[str, Any]:
    """The DP's exact optimum per K: the best token efficiency any K-bucket, pad-to-bound plan can reach."""
    table = []
    for k in range(1, k_max + 1):
        bounds = fit_boundaries(lengths, k, "optimal", max_len=max_len)
        table.append({"k": k, "token_efficiency": token_efficiency(lengths, bounds), "bounds": bounds})
    reach = [t["k"] for t in table if t["token_efficiency"] >= target]
    return {"dp_optimum_by_k": table, "min_k_for_target_token_efficiency": reach[0] if reach else None}


def targets(rows: list[dict], k: int, target_eff: float, dp: dict) -> dict[str, Any]:
    """The batching targets (token efficiency at K buckets, ≤ 16 shapes, ≥ 4× pad-to-max and ≥ 1× HF's length
    grouping in samples/s; packing's token efficiency), each with the measured value and whether it was reached."""
    by = {r["name"]: r for r in rows}
    opt = by[f"optimal-{k}"]
    best = max((by[f"optimal-{k}"], by[f"optimal-{k}-max-tokens"]), key=lambda r: r["samples_per_s"])
    hf = by["hf-group-by-length"]
    out = {
        "optimal_token_efficiency": {"target": f">= {target_eff}", "value": opt["token_efficiency"],
                                     "reached": opt["token_efficiency"] >= target_eff,
                                     "dp_optimum_at_k": dp["dp_optimum_by_k"][k - 1]["token_efficiency"]
                                     if k <= len(dp["dp_optimum_by_k"]) else None},
        "optimal_distinct_shapes": {"target": "<= 16", "value": opt["distinct_shapes"],
                                    "reached": opt["distinct_shapes"] <= 16},
        "samples_per_s_vs_pad_to_max": {"target": ">= 4", "row": best["name"],
                                        "value": best["samples_per_s_vs_pad_to_max"],
                                        "reached": best["samples_per_s_vs_pad_to_max"] >= 4,
                                        "by_row": {r["name"]: r["samples_per_s_vs_pad_to_max"]
                                                   for r in (opt, by[f"optimal-{k}-max-tokens"])}},
        "samples_per_s_vs_hf_group_by_length": {"target": ">= 1", "row": best["name"],
                                                "value": best["samples_per_s"] / hf["samples_per_s"],
                                                "reached": best["samples_per_s"] >= hf["samples_per_s"],
                                                "by_row": {r["name"]: r["samples_per_s"] / hf["samples_per_s"]
                                                           for r in (opt, by[f"optimal-{k}-max-tokens"])}},
    }
    packed = next((r for r in rows if r["name"].startswith("packed-")), None)
    if packed is not None:
        out["packed_token_efficiency"] = {"target": f">= {target_eff} (by packing, not bucketing)",
                                          "row": packed["name"],
                                          "value": packed["token_efficiency"],
                                          "reached": packed["token_efficiency"] >= target_eff,
                                          "distinct_shapes": packed["distinct_shapes"],
                                          "samples_per_s_vs_pad_to_max": packed["samples_per_s_vs_pad_to_max"],
                                          "samples_per_s_vs_hf_group_by_length":
                                              packed["samples_per_s"] / hf["samples_per_s"]}
    if not out["optimal_token_efficiency"]["reached"]:
        out["optimal_token_efficiency"]["not_reached_reason"] = (
            f"the DP's exact optimum with K={k} pad-to-bound buckets is "
            f"{out['optimal_token_efficiency']['dp_optimum_at_k']:.4f} on this data; "
            f"the smallest K reaching {target_eff} is {dp['min_k_for_target_token_efficiency']}")
    return out


def run_batching_bench(cfg: RunConfig, run_dir: Path, notice: Callable[[str], None] = print) -> dict:
    """Run the benchmark with the ``bench_batching`` settings; write ``bench-batching.json``, ``.md`` and ``.png``
    into ``run_dir``.

    Raises:
        UserError: bad data/config (as for training).
    """
    from train.data import prepare_data
    from train.setup import build_run, start_run
    from train.tools.env import collect_env

    bc = cfg.bench_batching
    start = start_run(cfg, run_dir=False)
    device, policy = start.device, start.policy
    load_start = os.getloadavg()[0]
    bundle = prepare_data(cfg, None, notice=lambda _msg: None)
    lengths = bundle.splits["train"].lengths.astype(np.int64)
    if len(lengths) < bc.batch_size:
        raise UserError(f"bench-batching: the training split has {len(lengths)} samples, fewer than "
                        f"bench_batching.batch_size={bc.batch_size}")
    methods = build_methods(lengths, cfg.data.max_len, bc, cfg.train.seed)
    stats = {m.name: epoch_stats(m, lengths) for m in methods}
    run = build_run(cfg, bundle, device, policy, splits=())  # one model for every method; batches come from their plans
    model = run.model
    model.train()
    notice(f"bench-batching: {len(lengths)} training samples, {len(methods)} methods, "
           f"{bc.warmup_windows}+{bc.windows} rounds of ~{bc.window_samples} samples, model {cfg.model.preset}, "
           f"device {device}, precision {policy.mode}, {torch.get_num_threads()} threads")
    windows = time_methods(methods, TokenDataset(bundle.splits["train"]), bundle.pad_id,
                           lambda b: run.trainer.step(b, count=False),
                           bc, device, cfg.train.seed, notice, bar=cfg.train.progress)
    rows = summarize(methods, stats, windows)
    dp = dp_table(lengths, cfg.data.max_len, bc.k_table_max, bc.target_token_efficiency)
    result = {
        "schema_version": 1,
        "command": "bench-batching",
        "config": asdict(bc),
        "data": {"name": bundle.corpus.name, "train_samples": len(lengths), "mean_length": float(lengths.mean()),
                 "std_length": float(lengths.std()), "p99_length": float(np.percentile(lengths, 99)),
                 "max_length": int(lengths.max()), "max_len": cfg.data.max_len,
                 "vocab_size": bundle.vocab_size, "data_fingerprint": bundle.data_fingerprint},
        "model": {"preset": cfg.model.preset, "parameters": sum(p.numel() for p in model.parameters())},
        "results": rows,
        "targets": targets(rows, bc.num_buckets, bc.target_token_efficiency, dp),
        **dp,
        "env": {**collect_env(device), "precision": policy.mode, "num_threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(), "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0]},
    }
    from train.bench.batching_report import write_outputs

    write_outputs(result, run_dir)
    return result

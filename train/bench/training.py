"""Training benchmark: named configurations trained side by side in one process, interleaved.

Every configuration gets its own model (same seed, same initial weights), optimizer and batch
stream over the same real training split. After ``bench.warmup_steps`` untimed steps each, the
configurations take turns — ``bench.rounds`` × ``bench.window`` timed steps — so machine noise hits them
alike; each step is timed between device synchronisations. Figures per configuration:
samples/s and real tokens/s (median over windows), time to first step (model build → end of
the first step: includes compilation where enabled), step time p50/p90/p99, peak memory,
energy per sample (null + reason where unmeasurable) and MFU.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from train.config import RunConfig, build_config, parse_override
from train.config.hf_aliases import expand_hf_alias
from train.data import DataBundle, bucket_plan, make_loader, pack_layout
from train.errors import UserError
from train.model import EncoderSpec
from train.models import model_supports_packing
from train.perf.devices import mfu_fields
from train.perf.energy import EnergyMeter, per_unit
from train.perf.flops import StepFlops
from train.perf.memory import WindowPeakMemory
from train.perf.timer import StepTimer, percentiles
from train.precision import PrecisionPolicy
from train.setup import build_model
from train.tools.progress import beside, progress_bar
from train.trainer import Trainer, move, packed_inputs


@dataclass(frozen=True)
class BenchRow:
    """One named training configuration of ``make bench``: ``overrides`` on top of the base config; ``parent`` is the
    row it differs from by exactly one ``lever`` (None for the reference), so ``samples_per_s_vs_parent`` is that
    lever's own contribution."""

    overrides: tuple[str, ...]
    parent: Optional[str] = None
    lever: Optional[str] = None


# The ablation chain, every step one lever. Precision "auto" is what train.precision=auto decides on this device
# (the same decision for every auto row); a Hugging Face user switches it on too (bf16=True), so hf-style has it.
CONFIGS: dict[str, BenchRow] = {
    "naive": BenchRow(("batching.method=pad-to-max", "batching.max_tokens=null", "train.precision=fp32")),
    "naive+precision-auto": BenchRow(("batching.method=pad-to-max", "batching.max_tokens=null", "train.precision=auto"),
                                     "naive", "precision auto"),
    "naive+buckets": BenchRow(("batching.method=optimal", "batching.max_tokens=null", "train.precision=fp32"),
                              "naive", "fitted buckets (fp32)"),
    "hf-style": BenchRow(("batching.method=hf-group-by-length", "batching.max_tokens=null", "train.precision=auto"),
                         "naive+precision-auto", "HF group_by_length: length-grouped batches padded to the batch max"),
    "optimized-fixed-batch": BenchRow(("batching.method=optimal", "batching.max_tokens=null", "train.precision=auto"),
                                      "hf-style", "fitted buckets instead of HF length grouping"),
    "optimized": BenchRow(("batching.method=optimal", "train.precision=auto"), "optimized-fixed-batch",
                          "token budget instead of a fixed batch size"),
    "optimized-packed": BenchRow(("batching.method=packed", "train.precision=auto"), "optimized",
                                 "sequence packing (rows of data.max_len, block-diagonal attention) instead of buckets"),
}


def describe(cfg: RunConfig, policy: PrecisionPolicy) -> str:
    """A row's settings in words, from its resolved config: precision, batching, batch size or token budget, compile."""
    b = cfg.batching
    batching = {"pad-to-max": f"every batch padded to data.max_len={cfg.data.max_len}",
                "hf-group-by-length": "HF group_by_length megabatches, padded to the batch max",
                "random": "random batches padded to the batch max"}.get(
        b.method, f"{b.method} buckets (K={b.num_buckets}) padded to the {'bucket bound' if b.pad_to == 'bound' else 'batch max'}")
    size = f"token budget {b.max_tokens}" if b.max_tokens and b.method in ("optimal", "quantile", "kmeans") else \
        f"batch size {b.batch_size}"
    if b.method == "packed":
        batching = f"sequence packing into rows of {b.pack_len or cfg.data.max_len} tokens (block-diagonal attention)"
        size = f"{'token budget ' + str(b.max_tokens) if b.max_tokens else 'about batch size ' + str(b.batch_size)} " \
               "worth of rows per step"
    precision = policy.mode + (" (auto)" if cfg.train.precision == "auto" else "")
    return f"{precision}; {batching}; {size}; compile off (eager steps; make bench-compile measures compile)"


@dataclass
class _Arm:
    """One configuration's live state during the benchmark."""

    name: str
    description: str
    cfg: RunConfig
    bundle: DataBundle
    trainer: Trainer
    batches: Iterator[dict]
    flops: StepFlops
    policy: PrecisionPolicy
    first_step_s: Optional[float] = None
    step_ms: list[float] = field(default_factory=list)
    window_samples_per_s: list[float] = field(default_factory=list)
    window_tokens_per_s: list[float] = field(default_factory=list)
    samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    flops_total: float = 0.0
    seq_lens: set = field(default_factory=set)
    peak_memory: dict = field(default_factory=dict)
    energy_j: Optional[float] = 0.0
    energy_reason: Optional[str] = None
    energy_source: Optional[str] = None


def arm_config(base: RunConfig, overrides: list[str]) -> RunConfig:
    """``base`` with ``section.key=value`` overrides applied, validated like the command line's."""
    raw, flags = base.to_dict(), {}
    for text in overrides:
        (section, key), value = parse_override(text)
        pairs = expand_hf_alias(key, value, raw, flags)[0] if not section else [((section, key), value)]  # an HF flag
        for (section, key), value in pairs:
            raw[section][key] = value
    return build_config(raw, "bench configuration")


def skip_reason(base: RunConfig, name: str) -> Optional[str]:
    """Why row ``name`` (a key of :data:`CONFIGS`) cannot run on ``base``'s model, or None when it can: a row of
    packed batches needs a model that takes per-sample positions and a block mask (``supports_packing``). An
    unknown name gives None (:func:`run_training_bench` refuses it)."""
    if name not in CONFIGS or "batching.method=packed" not in CONFIGS[name].overrides \
            or model_supports_packing(base.model.source):
        return None
    return (f"model.source={base.model.source} cannot run packed rows (supports_packing is false: it takes no "
            "per-sample positions or block-diagonal mask)")


def runnable_rows(base: RunConfig, names: list[str], notice: Callable[[str], None] = print
                  ) -> tuple[list[str], dict[str, str]]:
    """``(rows of names that can run on base's model, {skipped row: reason})``, one ``notice`` line per skipped row.

    Raises:
        UserError: every row of ``names`` is one this model cannot run (naming the rows, the model and the fix).
    """
    skipped = {n: r for n in names if (r := skip_reason(base, n)) is not None}
    runnable = [n for n in names if n not in skipped]
    if skipped and not runnable:
        first = next(iter(skipped))
        raise UserError(f"bench.configs={','.join(names)}: row {first} needs packed batches, which "
                        f"model.source={base.model.source} cannot run (supports_packing is false); choose rows without "
                        f"packing (e.g. bench.configs={CONFIGS[first].parent or 'optimized'}, or bench.configs=null "
                        "for every row this model can run) or model.source=builtin")
    for n, reason in skipped.items():
        notice(f"bench: skipping row {n}: {reason}")
    return runnable, skipped


def _endless(loader: Any) -> Iterator[dict]:
    epoch = 0
    while True:
        loader.batch_sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build_arm(name: str, cfg: RunConfig, base_bundle: DataBundle, device: torch.device,
               notice: Callable[[str], None]) -> _Arm:
    t0 = time.perf_counter()
    tr = base_bundle.splits["train"]
    bounds, pad_to, plan, source = bucket_plan(cfg, tr.lengths, base_bundle.data_fingerprint,
                                               base_bundle.tokenizer_info["fingerprint"], None, False, lambda _m: None)
    bundle = dataclasses.replace(base_bundle, bounds=bounds, pad_to=pad_to, plan=plan, plan_source=source)
    _seed(cfg.train.seed)
    model = build_model(cfg, bundle).to(device)
    policy = PrecisionPolicy.for_config(cfg, device)
    loader = make_loader(bundle, "train", cfg, train=True, device=device)
    trainer = Trainer(cfg=cfg, model=model, policy=policy, device=device, train_loader=loader, num_classes=bundle.num_classes)
    description = describe(cfg, policy)
    arm = _Arm(name=name, description=description, cfg=cfg, bundle=bundle, trainer=trainer, batches=_endless(loader),
               flops=StepFlops(model.spec) if isinstance(model.spec, EncoderSpec) else lambda _b, _s: 0,  # MFU: encoder only
               policy=policy)
    arm.first_step_s = -t0  # completed after the first step
    notice(f"bench: {name}: {description}; buckets {bounds}")
    return arm


def _step(arm: _Arm, timer: StepTimer, resolve: bool = False) -> tuple[int, int, int, int]:
    """One timed training step: (rows, length, samples, real tokens); rows = samples except for packed batches.
    Its duration is read by ``timer.flush()`` (``resolve``: now, waiting for the device)."""
    timer.start()
    batch = next(arm.batches)
    ids, mask, labels = move(batch, arm.trainer.device)
    arm.trainer.train_step(ids, mask, labels, **packed_inputs(batch, arm.trainer.device))
    timer.stop(resolve=resolve)
    b, s = ids.shape
    return b, s, batch.get("samples", b), batch["real_tokens"]


def run_training_bench(base: RunConfig, base_bundle: DataBundle, device: torch.device, names: list[str],
                       notice: Callable[[str], None] = print, precision: Optional[str] = None) -> list[dict[str, Any]]:
    """Benchmark ``names`` (keys of :data:`CONFIGS`) with the ``bench`` settings of ``base`` (``warmup_steps``,
    ``rounds``, ``window``) and return one result row per configuration. ``precision`` (e.g. ``fp32``) replaces
    every row's ``train.precision`` (the regression gate pins it so its ratios mean the same on every CPU). Rows
    the model cannot run are skipped with a notice (:func:`runnable_rows`; ``run_bench`` records why in bench.json).

    Raises:
        UserError: an unknown configuration name, an invalid override combination, or only rows this model
            cannot run.
    """
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise UserError(f"bench.configs: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    names = runnable_rows(base, names, notice)[0]
    b = base.bench
    warmup_steps, rounds, window = max(1, b.warmup_steps), b.rounds, b.window
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    arms: list[_Arm] = []
    with progress_bar(len(names) * (warmup_steps + rounds * window), "bench training", base.train.progress) as bar:
        say = beside(bar, notice)
        for name in names:
            overrides = list(CONFIGS[name].overrides) + ([f"train.precision={precision}"] if precision else [])
            arm = _build_arm(name, arm_config(base, overrides), base_bundle, device, say)
            timer = StepTimer(device)
            for i in range(warmup_steps):
                _step(arm, timer, resolve=True)
                if i == 0:
                    arm.first_step_s = arm.first_step_s + time.perf_counter()
            bar.update(warmup_steps)
            arms.append(arm)
        memory = WindowPeakMemory(device)
        for r in range(rounds):
            for arm in arms:
                _window(arm, window, device, memory)
                bar.update(window)
            say(f"bench: round {r + 1}/{rounds} done")
    return [_row(arm, device, device_name) for arm in arms]


def _window(arm: _Arm, window: int, device: torch.device, memory: WindowPeakMemory) -> None:
    """One timed window of ``window`` steps of ``arm``: step times, throughput, peak memory and energy."""
    timer = StepTimer(device)
    meter = EnergyMeter(device)
    memory.start()
    meter.start()
    w_samples, w_tokens = 0, 0
    for _ in range(window):
        b, s, n, real = _step(arm, timer)
        w_samples += n
        w_tokens += real
        arm.padded_tokens += b * s
        arm.flops_total += arm.flops(b, s)
        arm.seq_lens.add(s)
    step_ms = timer.flush()  # one wait for the device per window, not per step
    arm.step_ms.extend(step_ms)
    w_ms = sum(step_ms)
    energy = meter.stop()
    peak = memory.stop()
    if peak["peak_memory_bytes"] > arm.peak_memory.get("peak_memory_bytes", -1):
        arm.peak_memory = peak
    if energy["energy_j"] is None:
        arm.energy_j, arm.energy_reason = None, energy.get("energy_unavailable_reason")
    elif arm.energy_j is not None:
        arm.energy_j += energy["energy_j"]
        arm.energy_source = energy["energy_source"]
    arm.samples += w_samples
    arm.real_tokens += w_tokens
    arm.window_samples_per_s.append(w_samples / (w_ms / 1e3))
    arm.window_tokens_per_s.append(w_tokens / (w_ms / 1e3))


def _row(arm: _Arm, device: torch.device, device_name: str) -> dict[str, Any]:
    total_s = sum(arm.step_ms) / 1e3
    energy = {"energy_j": arm.energy_j, "energy_source": arm.energy_source,
              "energy_unavailable_reason": arm.energy_reason}
    steps = len(arm.step_ms)
    row: dict[str, Any] = {
        "name": arm.name,
        "description": arm.description,
        "parent": CONFIGS[arm.name].parent if arm.name in CONFIGS else None,
        "lever": CONFIGS[arm.name].lever if arm.name in CONFIGS else None,
        "precision": arm.policy.mode,
        "precision_reason": arm.policy.reason,
        "batching_method": arm.cfg.batching.method,
        "rows_per_step": pack_layout(arm.cfg, arm.bundle.splits["train"].lengths).rows
        if arm.cfg.batching.method == "packed" else None,
        "bucket_bounds": arm.bundle.bounds,
        "timed_steps": steps,
        "samples_per_s": float(np.median(arm.window_samples_per_s)),
        "tokens_per_s": float(np.median(arm.window_tokens_per_s)),
        "time_to_first_step_s": arm.first_step_s,
        "step_time_ms": percentiles(arm.step_ms),
        "token_efficiency": arm.real_tokens / arm.padded_tokens if arm.padded_tokens else None,
        "distinct_shapes": len(arm.seq_lens),
        "batch_size": arm.cfg.batching.batch_size,
        "max_tokens": arm.cfg.batching.max_tokens if arm.cfg.batching.method in ("optimal", "quantile", "kmeans") else None,
        "samples_per_epoch": _samples_per_epoch(arm),
        "samples_per_step_mean": arm.samples / steps if steps else None,
        **arm.peak_memory,
    }
    e = per_unit(energy, steps, arm.samples, arm.real_tokens)
    row.update({k: v for k, v in e.items() if k != "energy_j" or v is not None})
    row.update(mfu_fields(arm.flops_total / total_s if total_s and arm.flops_total else None, device, device_name,
                          arm.policy.mode))
    return row


def _samples_per_epoch(arm: _Arm) -> int:
    """Samples one epoch of this row's sampler yields: the split, less ``drop_last`` drops, plus DDP repeats."""
    sampler = arm.trainer.train_loader.batch_sampler
    return len(arm.bundle.splits["train"]) - sampler.dropped_samples + sampler.repeated_samples


def add_ratios(rows: list[dict[str, Any]], baselines: tuple[str, ...] = ("naive", "hf-style")) -> None:
    """Add ``samples_per_s_vs_<baseline>`` / ``tokens_per_s_vs_<baseline>`` to every row, and
    ``samples_per_s_vs_parent`` (the row's own lever: against the row it differs from by that lever alone), in place."""
    by_name = {r["name"]: r for r in rows}
    for base in baselines:
        ref = by_name.get(base)
        if ref is None:
            continue
        for r in rows:
            for key in ("samples_per_s", "tokens_per_s"):
                r[f"{key}_vs_{base}"] = r[key] / ref[key] if ref[key] else None
    for r in rows:
        parent = by_name.get(r.get("parent") or "")
        r["samples_per_s_vs_parent"] = r["samples_per_s"] / parent["samples_per_s"] if parent else None

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

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from train.bench.rows import CONFIGS, skip_reason
from train.config import RunConfig, build_config, parse_override
from train.config.hf_aliases import expand_hf_alias
from train.data import DataBundle, pack_layout
from train.errors import UserError
from train.models.flops import step_flops_for
from train.perf.ab import Arm, interleave
from train.perf.devices import mfu_fields
from train.perf.energy import EnergyMeter, per_unit
from train.perf.flops import VARLEN_FLOPS_METHOD
from train.perf.memory import WindowPeakMemory
from train.perf.timer import percentiles
from train.precision import PrecisionPolicy
from train.setup import BuiltRun, build_run, replan
from train.tools.progress import beside, progress_bar


def describe(cfg: RunConfig, policy: PrecisionPolicy, attention: Optional[str] = None) -> str:
    """A row's settings in words, from its resolved config: precision, batching, batch size or token budget, compile;
    ``attention``: the packed rows' path where ``model.packed_attention=auto`` was decided for the row."""
    b = cfg.batching
    batching = {"pad-to-max": f"every batch padded to data.max_len={cfg.data.max_len}",
                "hf-group-by-length": "HF group_by_length megabatches, padded to the batch max",
                "random": "random batches padded to the batch max"}.get(
        b.method, f"{b.method} buckets (K={b.num_buckets}) padded to the "
                  f"{'bucket bound' if b.pad_to == 'bound' else 'batch max'}")
    size = f"token budget {b.max_tokens}" if b.max_tokens and b.method in ("optimal", "quantile", "kmeans") else \
        f"batch size {b.batch_size}"
    if b.method == "packed":
        path = cfg.model.packed_attention + (f" → {attention}" if attention else "")
        batching = f"sequence packing into rows of {b.pack_len or cfg.data.max_len} tokens (attention {path})"
        size = f"{'token budget ' + str(b.max_tokens) if b.max_tokens else 'about batch size ' + str(b.batch_size)} " \
               "worth of rows per step"
    precision = policy.mode + (" (auto)" if cfg.train.precision == "auto" else "")
    return f"{precision}; {batching}; {size}; compile off (eager steps; make bench-compile measures compile)"


@dataclass
class RowArm:
    """One configuration during the benchmark: its built run and what its timed windows measured."""

    name: str
    description: str
    run: BuiltRun
    first_step_s: Optional[float] = None
    seq_lens: set = field(default_factory=set)
    flops: float = 0.0
    count_flops: Callable[[int, int], float] = lambda _b, _s: 0  # FLOPs of a [b, s] step
    flops_method: Optional[str] = None
    result: Any = None  # its ArmResult once measured

    def step(self) -> dict[str, float]:
        """One step of ``make train``'s own :meth:`Trainer.step` on the row's next batch; its counts."""
        rec = self.run.trainer.step()
        self.seq_lens.add(rec.seq_len)
        if rec.attention_pairs:  # varlen attention (decoders: ModuleFlops): counted per sample group
            self.flops += self.count_flops.for_step(rec.rows, rec.seq_len, rec.attention_pairs)
        else:
            self.flops += self.count_flops(rec.rows, rec.seq_len)
        return rec.counts()

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict]:
        """Around a timed window: peak memory, energy, and the steps' own durations (one device wait per window)."""
        device = self.run.device
        memory, meter, out = WindowPeakMemory(device), EnergyMeter(device), {}
        memory.start()
        meter.start()
        self.run.trainer.timer.flush()
        yield out
        out["step_ms"] = self.run.trainer.timer.flush()
        out["energy"] = meter.stop()
        out["memory"] = memory.stop()

def arm_config(base: RunConfig, overrides: list[str]) -> RunConfig:
    """``base`` with ``section.key=value`` overrides applied, validated like the command line's."""
    raw, flags = base.to_dict(), {}
    raw["model"]["fast_dropout"] = "false"  # a row's lever is in its overrides, never the base's auto
    for text in overrides:
        (section, key), value = parse_override(text)
        pairs = expand_hf_alias(key, value, raw, flags)[0] if not section else [((section, key), value)]  # an HF flag
        for (section, key), value in pairs:
            raw[section][key] = value
    return build_config(raw, "bench configuration")


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


def build_arm(name: str, cfg: RunConfig, base_bundle: DataBundle, device: torch.device, policy: PrecisionPolicy,
              notice: Callable[[str], None]) -> RowArm:
    """Row ``name``'s run, built by the one set-up (``build_run``) on ``base_bundle`` re-planned for ``cfg``."""
    t0 = time.perf_counter()
    run = build_run(cfg, replan(cfg, base_bundle), device, policy)
    chosen = run.attention.path if run.attention is not None and cfg.model.packed_attention == "auto" else None
    arm = RowArm(name=name, description=describe(cfg, policy, chosen), run=run, first_step_s=-t0)  # done at step 1
    arm.count_flops, arm.flops_method = step_flops_for(run.model)  # any model (MFU for hf: and python: too)
    if getattr(run.model, "packed_attention", None) == "varlen":
        arm.flops_method += VARLEN_FLOPS_METHOD
    notice(f"bench: {name}: {arm.description}; buckets {run.bundle.bounds}")
    return arm


def auto_precision(base: RunConfig, device: torch.device, rows: list[RunConfig]) -> Optional[PrecisionPolicy]:
    """The one ``train.precision=auto`` decision of a benchmark: decided once (measured or cached) when any row asks
    for ``auto``, so every ``auto`` row trains in the same precision; None when no row does."""
    if not any(c.train.precision == "auto" for c in rows):
        return None
    return PrecisionPolicy.for_config(arm_config(base, ["train.precision=auto"]), device)


def run_training_bench(base: RunConfig, base_bundle: DataBundle, device: torch.device, names: list[str],
                       notice: Callable[[str], None] = print, precision: Optional[str] = None,
                       auto: Optional[PrecisionPolicy] = None) -> list[dict[str, Any]]:
    """Benchmark ``names`` (keys of :data:`CONFIGS`) with the ``bench`` settings of ``base`` (``warmup_steps``,
    ``rounds``, ``window``) through the one A/B primitive (:func:`train.perf.ab.interleave`) and return one result row
    per configuration. ``precision`` (e.g. ``fp32``) replaces every row's ``train.precision`` (the regression gate
    pins it so its ratios mean the same on every CPU). ``auto``: the run's one ``precision=auto`` policy (decided
    here once when None). Rows the model cannot run are skipped with a notice (:func:`runnable_rows`).

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
    cfgs = [arm_config(base, list(CONFIGS[n].overrides) + ([f"train.precision={precision}"] if precision else []))
            for n in names]
    auto = auto or auto_precision(base, device, cfgs)
    arms: list[RowArm] = []
    with progress_bar(len(names) * (warmup_steps + rounds * window), "bench training", base.train.progress) as bar:
        say = beside(bar, notice)
        for name, cfg in zip(names, cfgs):
            policy = auto if cfg.train.precision == "auto" else PrecisionPolicy.for_config(cfg, device)
            arm = build_arm(name, cfg, base_bundle, device, policy, say)
            for i in range(warmup_steps):  # built and warmed one after another: time to first step is its own
                arm.run.trainer.step(resolve=True)
                if i == 0:
                    arm.first_step_s += time.perf_counter()
            arm.seq_lens.clear()
            arm.flops = 0.0
            bar.update(warmup_steps)
            arms.append(arm)

        def done(r: int) -> None:
            bar.update(window * len(arms))
            say(f"bench: round {r + 1}/{rounds} done")

        result = interleave([Arm(a.name, a.step, a.measure) for a in arms], rounds=rounds, window=window, warmup=0,
                            device=device, on_round=done)
    for arm in arms:
        arm.result = result.arms[arm.name]
    rows = [_row(arm, device, device_name) for arm in arms]
    for row in rows:
        row["load_1min_start"], row["load_1min_end"] = result.load_start, result.load_end
    add_intervals(rows, result)
    return rows


def add_intervals(rows: list[dict[str, Any]], result: Any) -> None:
    """``samples_per_s_vs_parent_interval``: each row's paired per-round ratio to its parent row, with its interval
    and verdict (:class:`train.perf.ab.Ratio`), where both rows ran."""
    names = {r["name"] for r in rows}
    for r in rows:
        parent = r.get("parent")
        r["vs_parent"] = result.ratio(r["name"], parent).as_dict() if parent in names else None


def _row(arm: RowArm, device: torch.device, device_name: str) -> dict[str, Any]:
    res, run = arm.result, arm.run
    step_ms = [ms for w in res.windows for ms in w.extra["step_ms"]]
    total_s = res.total("seconds")
    samples, real, padded, steps = (res.total(k) for k in ("samples", "real_tokens", "padded_tokens", "steps"))
    energy_j, reason, source = 0.0, None, None
    for w in res.windows:
        e = w.extra["energy"]
        if e["energy_j"] is None:
            energy_j, reason = None, e.get("energy_unavailable_reason")
        elif energy_j is not None:
            energy_j, source = energy_j + e["energy_j"], e["energy_source"]
    peak = max((w.extra["memory"] for w in res.windows), key=lambda m: m["peak_memory_bytes"])
    energy = {"energy_j": energy_j, "energy_source": source, "energy_unavailable_reason": reason}
    cfg = run.cfg
    row: dict[str, Any] = {
        "name": arm.name,
        "description": arm.description,
        "parent": CONFIGS[arm.name].parent if arm.name in CONFIGS else None,
        "lever": CONFIGS[arm.name].lever if arm.name in CONFIGS else None,
        "precision": run.policy.mode,
        "precision_reason": run.policy.reason,
        "batching_method": cfg.batching.method,
        "rows_per_step": pack_layout(cfg, run.bundle.splits["train"].lengths).rows
        if cfg.batching.method == "packed" else None,
        "bucket_bounds": run.bundle.bounds,
        "timed_steps": steps,
        "samples_per_s": res.median("samples"),
        "tokens_per_s": res.median("real_tokens"),
        "time_to_first_step_s": arm.first_step_s,
        "step_time_ms": percentiles(step_ms),
        "token_efficiency": real / padded if padded else None,
        "distinct_shapes": len(arm.seq_lens),
        "batch_size": cfg.batching.batch_size,
        "max_tokens": cfg.batching.max_tokens if cfg.batching.method in ("optimal", "quantile", "kmeans") else None,
        "samples_per_epoch": _samples_per_epoch(arm),
        "samples_per_step_mean": samples / steps if steps else None,
        **peak,
    }
    e = per_unit(energy, steps, samples, real)
    row.update({k: v for k, v in e.items() if k != "energy_j" or v is not None})
    row.update(mfu_fields(arm.flops / total_s if total_s and arm.flops else None, device, device_name,
                          run.policy.mode))
    row["flops_method"] = arm.flops_method
    return row


def _samples_per_epoch(arm: RowArm) -> int:
    """Samples one epoch of this row's sampler yields: the split, less ``drop_last`` drops, plus DDP repeats."""
    sampler = arm.run.loaders["train"].batch_sampler
    return len(arm.run.bundle.splits["train"]) - sampler.dropped_samples + sampler.repeated_samples


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

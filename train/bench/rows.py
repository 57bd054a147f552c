"""The rows of ``make bench``'s training suite (:data:`CONFIGS`: name → overrides, parent row, lever) and which of
them a model cannot run (:func:`skip_reasons`). Pure data and string checks: a training run's report lists
the rows its model would skip without importing the bench suite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.config import RunConfig
from train.models import model_supports_packing


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
                                 "sequence packing (rows of data.max_len, model.packed_attention=auto) "
                                 "instead of buckets"),
    "optimized-packed-mask": BenchRow(("batching.method=packed", "train.precision=auto",
                                       "model.packed_attention=sdpa-mask"), "optimized",
                                      "sequence packing with the row-dense block mask (model.packed_attention="
                                      "sdpa-mask) instead of buckets"),
    "optimized+fast-dropout": BenchRow(("batching.method=optimal", "train.precision=auto", "model.fast_dropout=true"),
                                       "optimized",
                                       "dropout masks drawn as 16-bit uniform integers (model.fast_dropout)"),
}
"""Rows without ``model.fast_dropout`` run ``nn.Dropout`` (:func:`arm_config` pins it), so only the
``optimized+fast-dropout`` row's ratio to its parent carries that lever."""


def skip_reason(base: RunConfig, name: str) -> Optional[str]:
    """Why row ``name`` (a key of :data:`CONFIGS`) cannot run on ``base``'s model, or None when it can: a row of
    packed batches needs a model that takes per-sample positions and a block mask (``supports_packing``). An
    unknown name gives None (:func:`run_training_bench` refuses it)."""
    if name not in CONFIGS or "batching.method=packed" not in CONFIGS[name].overrides \
            or model_supports_packing(base.model.source, base.model.task):
        return None
    return (f"model.source={base.model.source} cannot run packed rows (supports_packing is false: it takes no "
            "per-sample positions or block-diagonal mask)")


def skip_reasons(base: RunConfig) -> dict[str, Optional[str]]:
    """Every row of :data:`CONFIGS` → why it cannot run on ``base``'s model (:func:`skip_reason`), or None."""
    return {n: skip_reason(base, n) for n in CONFIGS}

"""The benchmark sections of ``RunConfig``: ``bench``, ``bench_batching``, ``bench_precision``, ``bench_compile``,
``bench_tracking``. Their defaults live here only: each command's flags (``--rounds`` …) just set these keys,
as ``section.key=value`` overrides and a YAML block do. Each field has its docstring and is validated in
``__post_init__`` (bad values raise UserError naming the key).

Kept out of :mod:`train.bench` on purpose: importing ``train.config`` must not import torch, and
``train/bench/__init__.py`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.errors import UserError


def _at_least(section: str, obj: object, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < minimum:
            raise UserError(f"{section}.{name} must be ≥ {minimum} (got {getattr(obj, name)})")


@dataclass
class BenchConfig:
    """``python -m train bench``: the training configurations side by side, then the inference benchmark."""

    configs: Optional[str] = None
    """Comma-separated training configurations to run (names from train/bench/training.py ``CONFIGS``:
    naive, hf-style, optimized, naive+buckets, naive+precision-auto); null = all of them."""
    warmup_steps: int = 3
    """Untimed steps per configuration before the timed rounds (the first one is its time to first step)."""
    rounds: int = 4
    """Rounds of interleaved timed windows (every configuration once per round)."""
    window: int = 5
    """Timed steps per configuration per round; each configuration gets ``rounds`` × ``window`` timed steps."""
    checkpoint: Optional[str] = None
    """``checkpoint.pt`` to serve in the inference benchmark; null = a freshly initialised model."""
    requests: int = 200
    """Inference requests, answered one by one and then in batches."""
    inference_batch_size: int = 32
    """Requests per call in the batched inference mode."""
    skip_inference: bool = False
    """Run the training benchmark only."""

    def __post_init__(self) -> None:
        _at_least("bench", self, 1, "warmup_steps", "rounds", "window", "requests", "inference_batch_size")
        if self.configs is not None and not self.config_names():
            raise UserError("bench.configs must name at least one configuration, or be null for all")

    def config_names(self) -> Optional[list[str]]:
        """The configurations named in ``configs`` (None: all)."""
        if self.configs is None:
            return None
        return [n.strip() for n in self.configs.split(",") if n.strip()]


@dataclass
class BenchBatchingConfig:
    """``python -m train bench-batching``: sizes of the batching benchmark (data, model and precision come from
    the rest of the run config)."""

    num_buckets: int = 16
    """K for the ``optimal-<K>`` rows (≤ 16 keeps at most 16 sequence lengths)."""
    batch_size: int = 64
    """Samples per batch for every row except ``optimal-<K>-max-tokens``."""
    max_tokens: int = 2048
    """Token budget per padded batch for the ``optimal-<K>-max-tokens`` row (configs/cpu-tiny.yaml's value)."""
    window_samples: int = 256
    """Samples per timed window (a window ends at the first batch boundary at or past this)."""
    windows: int = 3
    """Timed windows per method; samples/s and tokens/s are their medians."""
    warmup_windows: int = 1
    """Untimed rounds first (allocator, oneDNN primitive caches, first-touch of the weights)."""
    k_table_max: int = 32
    """``dp_optimum_by_k`` lists the DP's exact optimum for K = 1 … this."""
    target_token_efficiency: float = 0.97
    """The issue's target for ``optimal-<K>`` (reported as reached or not, never adjusted)."""

    def __post_init__(self) -> None:
        _at_least("bench_batching", self, 1, "num_buckets", "batch_size", "max_tokens", "window_samples", "windows",
                  "k_table_max")
        _at_least("bench_batching", self, 0, "warmup_windows")
        if not 0 < self.target_token_efficiency <= 1:
            raise UserError("bench_batching.target_token_efficiency must be in (0, 1]")


@dataclass
class BenchPrecisionConfig:
    """``python -m train bench-precision``: how long each precision row trains."""

    steps: int = 150
    """Training steps per row (every row sees the same batches; sets the LR schedule's length)."""
    bf16_cpu_steps: int = 4
    """On a CPU: steps of the timing-only bf16 row (0: no such row)."""
    warmup: int = 3
    """First steps left out of the step-time median (a row shorter than this drops only its first step)."""

    def __post_init__(self) -> None:
        _at_least("bench_precision", self, 2, "steps")
        _at_least("bench_precision", self, 0, "bf16_cpu_steps", "warmup")
        if self.warmup >= self.steps:
            raise UserError(f"bench_precision.warmup={self.warmup} must be < bench_precision.steps={self.steps}")


@dataclass
class BenchCompileConfig:
    """``python -m train bench-compile``: the in-process eager vs compiled step-time comparison."""

    steps: int = 8
    """Timed steps per configuration (eager, compiled) per round."""
    rounds: int = 5
    """Interleaved rounds (eager, compiled, compiled, eager, …)."""

    def __post_init__(self) -> None:
        _at_least("bench_compile", self, 2, "steps")
        _at_least("bench_compile", self, 1, "rounds")


@dataclass
class BenchTrackingConfig:
    """``python -m train bench-tracking``: blocks of training steps with no / JSONL / full tracking, interleaved."""

    rounds: int = 5
    """Interleaved rounds; each runs one block per condition (none, jsonl, full)."""
    block_steps: int = 100
    """Optimizer steps per block."""
    online_check: bool = False
    """Also time W&B forced online with no reachable server (bounded by ``tracking.init_timeout_s``)."""
    out: Optional[str] = None
    """Result JSON path; null = ``runs/<id>/bench-tracking.json``."""

    def __post_init__(self) -> None:
        _at_least("bench_tracking", self, 1, "rounds")
        _at_least("bench_tracking", self, 2, "block_steps")

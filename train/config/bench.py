"""The benchmark sections of ``RunConfig``: ``bench``, ``bench_batching``, ``bench_precision``, ``bench_compile``,
``bench_tracking``, ``bench_gate``. Their defaults live here only: each command's flags (``--rounds`` …) just set
these keys,
as ``section.key=value`` overrides and a YAML block do. Each field has its docstring; its accepted values
are declared on the field (``allowed(…)``, train/errors.py) and checked in ``__post_init__``.

Kept out of :mod:`train.bench` on purpose: importing ``train.config`` must not import torch, and
``train/bench/__init__.py`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.errors import Frozen, UserError, allowed, check_fields, comma_list


@dataclass
class BenchConfig(Frozen):
    """``python -m train bench``: the training configurations side by side, then the inference benchmark."""

    configs: Optional[str] = None
    """Comma-separated training configurations to run (names from train/bench/rows.py ``CONFIGS``:
    naive, hf-style, optimized, naive+buckets, naive+precision-auto); null = all of them."""
    warmup_steps: int = allowed(3, ge=1)
    """Untimed steps per configuration before the timed rounds (the first one is its time to first step)."""
    rounds: int = allowed(4, ge=1)
    """Rounds of interleaved timed windows (every configuration once per round)."""
    warmup_runs: int = allowed(1, ge=0)
    """``bench-vs-hf``: untimed whole training runs per side, in turn, before its ``rounds`` timed ones (oneDNN's
    primitive cache, the allocator and the kernels' first use see every batch shape once; a cold first round reads
    far below the warm ones: docs/models.md). 0: the first round runs cold."""
    cold_runs: int = allowed(0, ge=0)
    """``bench-vs-hf``: repetitions of the cold comparison after the warm one — each side's whole one-epoch run in a
    fresh process (interpreter start, imports, the prepared data from its cache, model build, training; no
    evaluation), the sides in a rotating order; real tokens of the epoch ÷ the process's wall time. 0: none."""
    cold_side: Optional[str] = None
    """Set by ``bench-vs-hf`` on its own child processes (one cold side run each); not a user setting."""
    window: int = allowed(5, ge=1)
    """Timed steps per configuration per round; each configuration gets ``rounds`` × ``window`` timed steps."""
    checkpoint: Optional[str] = None
    """``checkpoint.pt`` to serve in the inference benchmark; null = a freshly initialised model."""
    requests: int = allowed(200, ge=1)
    """Inference requests, answered one by one and then in batches."""
    inference_batch_size: int = allowed(32, ge=1)
    """Requests per call in the batched inference mode."""
    inference_batching: str = allowed("auto", choices=("auto", "packed", "bucket"))
    """How a call's requests share forwards: ``packed`` (whole requests back to back in rows, one forward per call;
    the model's packed path), ``bucket`` (one forward per bucket present, each padded to its bound), ``auto`` =
    ``packed`` when the model supports packing, else ``bucket``."""
    max_queue_delay_ms: float = allowed(5.0, ge=0)
    """Open-loop load: the dynamic batcher serves the queue once its oldest request has waited this long."""
    skip_inference: bool = False
    """Run the training benchmark only."""

    def __post_init__(self) -> None:
        check_fields(self, "bench")
        if self.configs is not None and not self.config_names():
            raise UserError("bench.configs must name at least one configuration, or be null for all")

    def config_names(self) -> Optional[list[str]]:
        """The configurations named in ``configs`` (None: all)."""
        return comma_list(self.configs)


@dataclass
class BenchBatchingConfig(Frozen):
    """``python -m train bench-batching``: sizes of the batching benchmark (data, model and precision come from
    the rest of the run config)."""

    num_buckets: int = allowed(16, ge=1)
    """K for the ``optimal-<K>`` rows (≤ 16 keeps at most 16 sequence lengths)."""
    batch_size: int = allowed(64, ge=1)
    """Samples per batch for every row except ``optimal-<K>-max-tokens``."""
    max_tokens: int = allowed(2048, ge=1)
    """Token budget per padded batch for the ``optimal-<K>-max-tokens`` row (configs/cpu-tiny.yaml's value)."""
    window_samples: int = allowed(256, ge=1)
    """Samples per timed window (a window ends at the first batch boundary at or past this)."""
    windows: int = allowed(3, ge=1)
    """Timed windows per method; samples/s and tokens/s are their medians."""
    warmup_windows: int = allowed(1, ge=0)
    """Untimed rounds first (allocator, oneDNN primitive caches, first-touch of the weights)."""
    k_table_max: int = allowed(32, ge=1)
    """``dp_optimum_by_k`` lists the DP's exact optimum for K = 1 … this."""
    target_token_efficiency: float = allowed(0.97, gt=0, le=1)
    """The issue's target for ``optimal-<K>`` (reported as reached or not, never adjusted)."""

    def __post_init__(self) -> None:
        check_fields(self, "bench_batching")


@dataclass
class BenchPrecisionConfig(Frozen):
    """``python -m train bench-precision``: how long each precision row trains."""

    steps: int = allowed(150, ge=2)
    """Training steps per row (every row sees the same batches; sets the LR schedule's length)."""
    bf16_cpu_steps: int = allowed(4, ge=0)
    """On a CPU: steps of the timing-only bf16 row (0: no such row)."""
    warmup: int = allowed(3, ge=0)
    """First steps left out of the step-time median (a row shorter than this drops only its first step)."""

    def __post_init__(self) -> None:
        check_fields(self, "bench_precision")
        if self.warmup >= self.steps:
            raise UserError(f"bench_precision.warmup={self.warmup} must be < bench_precision.steps={self.steps}")


@dataclass
class BenchCompileConfig(Frozen):
    """``python -m train bench-compile``: the in-process eager vs compiled step-time comparison."""

    steps: int = allowed(8, ge=2)
    """Timed steps per configuration (eager, compiled) per round."""
    rounds: int = allowed(5, ge=1)
    """Interleaved rounds (eager, compiled, compiled, eager, …)."""

    def __post_init__(self) -> None:
        check_fields(self, "bench_compile")


@dataclass
class BenchTrackingConfig(Frozen):
    """``python -m train bench-tracking``: blocks of training steps with no / JSONL / full tracking, interleaved."""

    rounds: int = allowed(5, ge=1)
    """Interleaved rounds; each runs one block per condition (none, jsonl, full)."""
    block_steps: int = allowed(100, ge=2)
    """Optimizer steps per block."""
    online_check: bool = False
    """Also time W&B forced online with no reachable server (bounded by ``tracking.init_timeout_s``)."""
    out: Optional[str] = None
    """Result JSON path; null = ``runs/<id>/bench-tracking.json``."""

    def __post_init__(self) -> None:
        check_fields(self, "bench_tracking")


@dataclass
class BenchGateConfig(Frozen):
    """``python -m train bench-gate`` / ``bench-baseline``: the performance regression gate
    (train/bench/gate.py).
    The run's length comes from the ``bench`` section (configs/bench-gate.yaml keeps it short)."""

    baseline: Optional[str] = None
    """The committed baseline JSON; null = ``bench/baseline-gpu.json`` on CUDA, else ``bench/baseline-cpu.json``."""
    configs: str = "naive,hf-style,optimized,optimized-packed"
    """The ``make bench`` rows the gate runs (ratios are taken between them)."""
    precision: str = allowed("fp32", choices=("fp32", "bf16", "fp16", "auto"))
    """Every row's precision. ``fp32`` on a CPU: the ratios then measure the batching code alike on an AVX2-only and an
    AVX512-BF16 CPU (``auto`` would pick differently); a GPU baseline uses ``auto``."""
    repeats: int = allowed(5, ge=1)
    """``bench-baseline``: measurements taken; the baseline holds their medians and the band their spread gives."""
    band_floor: float = allowed(0.15, gt=0, lt=1)
    """Smallest tolerance band on a timing ratio (a fraction: 0.15 = a ratio may fall 15% below the baseline's);
    ``bench-baseline`` widens it to twice the largest relative deviation it measured over ``repeats``."""

    def __post_init__(self) -> None:
        check_fields(self, "bench_gate")

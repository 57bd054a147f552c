"""Run configuration: nested dataclasses composed into one :class:`RunConfig`.

A run's config comes from (lowest to highest priority) the dataclass defaults, a YAML file
(``--config configs/cpu-tiny.yaml``) and ``section.key=value`` overrides on the command line
(values parsed as YAML, so ``train.max_steps=200`` is an int and ``data.max_samples=null`` is None).
Unknown keys and wrongly typed values raise :class:`~train.errors.UserError` naming the key and,
for typos, the nearest valid key.

``RunConfig`` and ``build_config`` live in ``run_config.py``, the YAML side in ``loading.py``, the sections in
``sections.py``, ``bench.py``, ``optimize.py`` and each component's own ``config.py``; this package re-exports them.
"""

from __future__ import annotations

from train.config.bench import (
    BenchBatchingConfig,
    BenchCompileConfig,
    BenchConfig,
    BenchGateConfig,
    BenchPrecisionConfig,
    BenchTrackingConfig,
)
from train.config.compiling import CompileConfig
from train.config.hf_aliases import expand_hf_alias
from train.config.loading import DuplicateKeyError, StrictLoader, dump_config, load_config, parse_override, strict_load
from train.config.memory import MemoryConfig
from train.config.optimize import OptimizeConfig
from train.config.profiling import ProfileConfig
from train.config.run_config import (
    BatchingConfig,
    ClipConfig,
    DataConfig,
    DistConfig,
    ModelConfig,
    NumericsConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    build_config,
)
from train.config.tracking import TrackingConfig

__all__ = [
    "RunConfig", "build_config",
    "load_config", "dump_config", "parse_override", "strict_load", "StrictLoader", "DuplicateKeyError",
    "expand_hf_alias",
    "DataConfig", "BatchingConfig", "ModelConfig", "OptimConfig", "TrainConfig", "ClipConfig", "NumericsConfig",
    "DistConfig", "MemoryConfig",
    "ProfileConfig", "TrackingConfig", "CompileConfig", "OptimizeConfig",
    "BenchConfig", "BenchBatchingConfig", "BenchPrecisionConfig", "BenchCompileConfig", "BenchTrackingConfig",
    "BenchGateConfig",
]

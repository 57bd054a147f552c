"""The run configuration: nested dataclasses composed into one :class:`RunConfig`, and :func:`build_config`, which
builds one from a nested dict, validating every key and value type (unknown keys name the nearest valid one)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from train.config.bench import (
    BenchBatchingConfig,
    BenchCompileConfig,
    BenchConfig,
    BenchGateConfig,
    BenchPrecisionConfig,
    BenchTrackingConfig,
)
from train.config.compiling import CompileConfig
from train.config.dist import DistConfig
from train.config.generate import GenerateConfig
from train.config.memory import MemoryConfig
from train.config.optimize import OptimizeConfig
from train.config.profiling import ProfileConfig
from train.config.sections import (
    BatchingConfig,
    ClipConfig,
    DataConfig,
    ModelConfig,
    NumericsConfig,
    OptimConfig,
    TrainConfig,
)
from train.config.tracking import TrackingConfig
from train.errors import Frozen, UserError


@dataclass
class RunConfig(Frozen):
    """Everything a run needs; saved fully resolved as ``runs/<id>/config.yaml``. The ``bench*`` sections
    (train/config/bench.py) are read only by the ``bench*`` commands."""

    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    bench_batching: BenchBatchingConfig = field(default_factory=BenchBatchingConfig)
    bench_precision: BenchPrecisionConfig = field(default_factory=BenchPrecisionConfig)
    bench_compile: BenchCompileConfig = field(default_factory=BenchCompileConfig)
    bench_tracking: BenchTrackingConfig = field(default_factory=BenchTrackingConfig)
    bench_gate: BenchGateConfig = field(default_factory=BenchGateConfig)
    optimize: OptimizeConfig = field(default_factory=OptimizeConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    def __post_init__(self) -> None:
        # optim.clip_norm is the old name of clip.max_norm: accept it, and keep it mirroring clip.max_norm.
        legacy, default = self.optim.clip_norm, ClipConfig.max_norm
        if legacy is not None and legacy != self.clip.max_norm:
            if self.clip.max_norm != default:
                raise UserError(f"optim.clip_norm={legacy} and clip.max_norm={self.clip.max_norm} disagree; "
                                "set only clip.max_norm (optim.clip_norm is its old name)")
            if legacy <= 0:
                raise UserError("optim.clip_norm must be > 0 (disable clipping with clip.method=none)")
            self.clip.max_norm = float(legacy)
        self.optim.clip_norm = self.clip.max_norm if self.clip.method == "global-norm" else None
        if self.data.long_text == "split" and self.model.task != "causal-lm":
            raise UserError(f"data.long_text=split cuts a text into data.max_len chunks, each a causal-LM sample; "
                            f"model.task={self.model.task} has one label per text: set data.long_text=truncate")
        if self.batching.pack_len is not None and self.batching.pack_len > self.data.max_len:
            raise UserError(f"batching.pack_len={self.batching.pack_len} exceeds data.max_len={self.data.max_len} (the "
                            "position table); lower batching.pack_len or raise data.max_len")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["optim"]["betas"] = list(self.optim.betas)
        return d

    def freeze(self) -> "RunConfig":
        """Make this config a value: every section refuses assignment from now on (returns ``self``)."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).freeze()
        super().freeze()
        return self

    def value(self, key: str) -> Any:
        """The value of ``"section.key"`` (the form :meth:`with_values` takes). Raises AttributeError: unknown key."""
        section, _, name = key.partition(".")
        return getattr(getattr(self, section), name)

    def with_values(self, changes: dict[str, Any], where: str = "resolved config") -> "RunConfig":
        """A new config: this one with ``{"section.key": value}`` applied, validated like a config file (a frozen
        config gives a frozen one). How a decision (``auto`` resolved, a drawn run id) changes a run's config.

        Raises:
            UserError: an unknown key or a value out of its range.
        """
        raw = self.to_dict()
        for key, value in changes.items():
            section, _, name = key.partition(".")
            if section not in raw or name not in raw[section]:
                raise UserError(f"{where}: unknown key {key}")
            raw[section][name] = value
        new = build_config(raw, where)
        return new.freeze() if self.frozen else new


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _check_type(value: Any, hint: Any, key: str) -> Any:
    """Return ``value`` converted to ``hint`` where lossless (int → float), else raise UserError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, key)
            except UserError:
                pass
        raise UserError(f"config key {key!r}: {value!r} is not a valid {_hint_name(hint)}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "5e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint is dict and isinstance(value, dict):
        return value
    if hint is tuple and isinstance(value, (list, tuple)):
        return tuple(value)
    if hint is list and isinstance(value, (list, tuple)):
        return list(value)
    if hint in (int, float, str, bool) and (type(value) is hint):
        return value
    if hint is Any:
        return value
    fix = ": set true or false" if hint is bool else ""
    raise UserError(f"config key {key!r}: {value!r} is not a valid {_hint_name(hint)}{fix}")


def _hint_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", str(hint))


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else f" Valid keys: {', '.join(candidates)}."


def build_config(raw: dict[str, Any], where: str = "config") -> RunConfig:
    """Build a :class:`RunConfig` from a nested dict, validating every key and value type.

    Raises:
        UserError: unknown section or key (with the nearest valid name), wrong type, or a value
            a section's ``__post_init__`` rejects.
    """
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping of sections (data, batching, model, optim, train)")
    sections: dict[str, Any] = {}
    hints = typing.get_type_hints(RunConfig)
    for name, values in raw.items():
        if name not in hints:
            raise UserError(f"{where}: unknown section {name!r}.{_suggest(name, list(hints))}")
        cls = hints[name]
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise UserError(f"{where}: section {name!r} must be a mapping of keys")
        field_hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in field_hints:
                full = [f"{name}.{k}" for k in _field_names(cls)]
                raise UserError(f"{where}: unknown key '{name}.{key}'.{_suggest(f'{name}.{key}', full)}")
            kwargs[key] = _check_type(value, field_hints[key], f"{name}.{key}")
        sections[name] = cls(**kwargs)
    return RunConfig(**sections)

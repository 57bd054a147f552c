"""Run configuration: nested dataclasses composed into one :class:`RunConfig`.

A run's config comes from (lowest to highest priority) the dataclass defaults, a YAML file
(``--config configs/cpu-tiny.yaml``) and ``section.key=value`` overrides on the command line
(values parsed as YAML, so ``train.max_steps=200`` is an int and ``data.max_samples=null`` is None).
Unknown keys and wrongly typed values raise :class:`~train.errors.UserError` naming the key and,
for typos, the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from train.compiling.config import CompileConfig
from train.config.bench import (
    BenchBatchingConfig,
    BenchCompileConfig,
    BenchConfig,
    BenchGateConfig,
    BenchPrecisionConfig,
    BenchTrackingConfig,
)
from train.config.hf_aliases import expand_hf_alias
from train.config.optimize import OptimizeConfig
from train.config.sections import (
    BatchingConfig,
    ClipConfig,
    DataConfig,
    ModelConfig,
    NumericsConfig,
    OptimConfig,
    TrainConfig,
)
from train.errors import Frozen, UserError
from train.profiling.config import ProfileConfig
from train.tracking.config import TrackingConfig


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
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    bench_batching: BenchBatchingConfig = field(default_factory=BenchBatchingConfig)
    bench_precision: BenchPrecisionConfig = field(default_factory=BenchPrecisionConfig)
    bench_compile: BenchCompileConfig = field(default_factory=BenchCompileConfig)
    bench_tracking: BenchTrackingConfig = field(default_factory=BenchTrackingConfig)
    bench_gate: BenchGateConfig = field(default_factory=BenchGateConfig)
    optimize: OptimizeConfig = field(default_factory=OptimizeConfig)

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
        from train.models import model_dir_tokenizer

        if self.data.tokenizer_path is None:  # the model directory's own tokenizer, if it has one
            self.data.tokenizer_path = model_dir_tokenizer(self.model.source, self.data.cache_dir)
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
    if hint in (int, float, str, bool) and (type(value) is hint):
        return value
    if hint is Any:
        return value
    raise UserError(f"config key {key!r}: {value!r} is not a valid {_hint_name(hint)}")


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


class DuplicateKeyError(yaml.YAMLError):
    """A mapping key given twice in one YAML document (PyYAML silently keeps the last one)."""

    def __init__(self, key: str, line: int, first_line: int) -> None:
        super().__init__(f"duplicate key {key} (first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping, at any level (:class:`DuplicateKeyError` with
    the dotted key path and both 1-based lines): ``max_steps: 3`` then ``max_steps: 5`` would silently use 5, and a
    second ``train:`` section would silently drop the whole first one. Keys merged in with ``<<: *anchor`` may be
    overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        paths = self.__dict__.setdefault("_key_paths", {})  # id(mapping node) -> its dotted path
        prefix = paths.get(id(node), "")
        first: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # SafeConstructor raises its own "found unhashable key"
            path = f"{prefix}.{key}" if prefix else str(key)
            line = key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKeyError(path, line, first[key])
            first[key] = line
            if isinstance(value_node, yaml.MappingNode):
                paths[id(value_node)] = path
            elif isinstance(value_node, yaml.SequenceNode):
                paths.update((id(item), f"{path}[{i}]") for i, item in enumerate(value_node.value))
        return super().construct_mapping(node, deep=deep)


def strict_load(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` for a key repeated in one mapping."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` (value as YAML); a bare ``key=value`` gives ``["", key]``: a Hugging Face flag name
    (:func:`train.config.hf_aliases.expand_hf_alias`). Raises UserError for a malformed override."""
    if "=" not in text:
        raise UserError(f"override {text!r} must look like section.key=value, e.g. train.max_steps=200")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) == 1 and parts[0]:  # a Hugging Face flag name (train/config/hf_aliases.py)
        parts = ["", parts[0]]
    elif len(parts) != 2 or not all(parts):
        raise UserError(f"override {text!r}: the key must be section.key, e.g. train.max_steps")
    try:
        parsed = strict_load(value) if value.strip() else None
    except DuplicateKeyError as exc:
        raise UserError(f"override {text!r}: {exc} in the value; keep one") from None
    except yaml.YAMLError as exc:
        raise UserError(f"override {text!r}: the value is not valid YAML ({exc.__class__.__name__})") from None
    return parts, parsed


def load_config(path: Optional[str], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load ``path`` (YAML, may be None for defaults) and apply ``section.key=value`` overrides.

    Raises:
        UserError: missing/unparsable file, a key given twice (any level: ``file:line: duplicate key
            train.max_steps (first at line 3); keep one``), unknown key, wrong type, invalid value.
    """
    raw: dict[str, Any] = {}
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist "
                            "(configs/ holds cpu-tiny.yaml, smoke.yaml, gpu-bert-base.yaml)")
        try:
            raw = strict_load(p.read_text(encoding="utf-8-sig")) or {}
        except DuplicateKeyError as exc:
            raise UserError(f"{p}:{exc.line}: {exc}; keep one") from None
        except UnicodeDecodeError as exc:
            line = p.read_bytes()[: exc.start].count(b"\n") + 1
            raise UserError(f"{p}:{line}: not valid UTF-8 (byte {exc.start}); save the config as UTF-8") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise UserError(f"{p}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{p}: expected a mapping of sections (data, batching, model, optim, train)")
    hf_flags: dict[str, Any] = {}  # the Hugging Face precision flags seen so far (bf16=true fp16=true is refused)
    for text in overrides:
        (section, key), value = parse_override(text)
        pairs = [((section, key), value)]
        if not section:  # a Hugging Face flag: one notice line says what it became
            pairs, notice = expand_hf_alias(key, value, raw, hf_flags)
            print(notice, file=sys.stderr, flush=True)
        for (section, key), value in pairs:
            sec = raw.setdefault(section, {})
            if not isinstance(sec, dict):
                raise UserError(f"{where}: section {section!r} must be a mapping of keys")
            sec[key] = value
        where = f"{where} + overrides" if "overrides" not in where else where
    return build_config(raw, where)


def dump_config(cfg: RunConfig) -> str:
    """The fully resolved config as YAML text (what ``runs/<id>/config.yaml`` holds)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

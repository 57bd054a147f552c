"""A run's config from text: a YAML file (keys repeated in one mapping refused) and ``section.key=value`` overrides
(values parsed as YAML; a bare Hugging Face flag name expanded), and the resolved config back to YAML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from train.config.hf_aliases import expand_hf_alias
from train.config.run_config import RunConfig, build_config
from train.errors import UserError


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
        UserError: missing/unparsable file, a directory, an empty file (blank lines and comments only), a key given
            twice (any level: ``file:line: duplicate key
            train.max_steps (first at line 3); keep one``), unknown key, wrong type, invalid value.
    """
    raw: dict[str, Any] = {}
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if p.is_dir():
            raise UserError(f"config file {p} is a directory; give one YAML file, e.g. configs/smoke.yaml")
        if not p.is_file():
            raise UserError(f"config file {p} does not exist "
                            "(configs/ holds cpu-tiny.yaml, smoke.yaml, gpu-bert-base.yaml)")
        try:
            raw = strict_load(p.read_text(encoding="utf-8-sig"))
        except DuplicateKeyError as exc:
            raise UserError(f"{p}:{exc.line}: {exc}; keep one") from None
        except UnicodeDecodeError as exc:
            line = p.read_bytes()[: exc.start].count(b"\n") + 1
            raise UserError(f"{p}:{line}: not valid UTF-8 (byte {exc.start}); save the config as UTF-8") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise UserError(f"{p}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
        if raw is None:  # nothing but blank lines, comments or a bare "---": a run on the defaults, unasked
            raise UserError(f"{p}: empty config file (no settings, only blank lines or comments); remove --config to "
                            "use the defaults, or add settings")
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

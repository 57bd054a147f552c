"""The source readers behind :func:`train.data.sources.scan_source`: built-in WordNet, JSONL, CSV, Parquet and
Hugging Face datasets, each yielding ``(key, text, raw_label, location)`` rows (validated and split by the caller)."""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import train.data.wordnet as wordnet  # the module itself, not the package: no package <-> submodule import loop
from train.config import DataConfig
from train.errors import UserError

Row = tuple[str, str, Any, str]  # (split key, text, raw label, location for messages)


def _wordnet_rows(cfg: DataConfig) -> Iterator[Row]:
    root = wordnet.find_wordnet_dir(cfg.wordnet_dir)
    for s in wordnet.iter_synsets(root):
        yield f"{s.pos}:{s.offset}", s.text, s.lex_filenum, f"{root} synset {s.pos}:{s.offset:08d}"


def _field(record: dict, name: str, what: str, loc: str) -> Any:
    if name not in record:
        have = ", ".join(map(str, record)) or "none"
        raise UserError(f"{loc}: no {what} field {name!r} (fields: {have}); set data.{what}_field to the right name")
    return record[name]


def _jsonl_rows(path: Path, cfg: DataConfig) -> Iterator[Row]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            loc = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is not data
            except UnicodeDecodeError as exc:
                raise UserError(f"{loc}: not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{loc}: malformed JSON ({exc.msg} at column {exc.colno}); "
                                "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise UserError(f"{loc}: expected a JSON object with {cfg.text_field!r} and {cfg.label_field!r}")
            text = _field(record, cfg.text_field, "text", loc)
            label = _field(record, cfg.label_field, "label", loc)
            yield str(text) if text is not None else "", text, label, loc


_INT = re.compile(r"[-+]?[0-9]+")  # ASCII digits only (str.isdigit accepts '²')
_FLOAT = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][-+]?[0-9]+)?")


def _csv_rows(path: Path, cfg: DataConfig) -> Iterator[Row]:
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # utf-8-sig: a leading BOM is not data
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            for name, what in ((cfg.text_field, "text"), (cfg.label_field, "label")):
                if name not in header:
                    raise UserError(f"{path}:1: no {what} column {name!r} (columns: {', '.join(header) or 'none'}); "
                                    f"set data.{what}_field to the right name")
            for record in reader:
                loc = f"{path}:{reader.line_num}"
                if None in record or any(v is None for v in record.values()):
                    raise UserError(f"{loc}: expected {len(header)} columns as in the header, got a different count")
                label: Any = record[cfg.label_field].strip()
                if _INT.fullmatch(label):
                    label = int(label)
                elif _FLOAT.fullmatch(label):  # as the JSONL reader: a classifier's label is a class id or a name
                    raise UserError(f"{loc}: label {label!r} must be a string or an integer "
                                    "(a float label: use integer class ids 0..K-1 or class names)")
                yield record[cfg.text_field], record[cfg.text_field], label, loc
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not valid UTF-8 (byte offset {exc.start} of a read block); "
                        "re-encode the file as UTF-8") from None
    except csv.Error as exc:
        raise UserError(f"{path}: malformed CSV ({exc})") from None


def _parquet_rows(path: Path, cfg: DataConfig) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        schema_names = pq.read_schema(path).names
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise UserError(f"{path}: not a readable Parquet file ({exc.__class__.__name__}: {exc})") from None
    for name, what in ((cfg.text_field, "text"), (cfg.label_field, "label")):
        if name not in schema_names:
            raise UserError(f"{path}: no {what} column {name!r} (columns: {', '.join(schema_names)}); "
                            f"set data.{what}_field")
    table = pq.read_table(path, columns=[cfg.text_field, cfg.label_field])
    texts = table.column(cfg.text_field).to_pylist()
    labels = table.column(cfg.label_field).to_pylist()
    for i, (text, label) in enumerate(zip(texts, labels)):
        yield str(text) if text is not None else "", text, label, f"{path}: row {i}"


def hub_reachable(timeout_s: float = 3.0) -> tuple[bool, str]:
    """(reachable, why not) for the Hugging Face Hub (``$HF_ENDPOINT``, default huggingface.co): one TCP connect,
    bounded by ``timeout_s``, so a machine without network fails in seconds, not after ``datasets``' retries."""
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True, ""
    except OSError as exc:
        return False, f"{host}:{port} cannot be reached ({exc.__class__.__name__}: {exc.strerror or exc})"


def _hf_rows(spec: str, cfg: DataConfig) -> Iterator[Row]:
    name, _, config_name = spec[3:].partition(":")
    online, why = (False, "HF_HUB_OFFLINE is set") if os.environ.get("HF_HUB_OFFLINE") == "1" else hub_reachable()
    if not online:  # before `import datasets`, which reads these: use the local cache only, no retries
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets  # lazy: optional dependency
    except ImportError:
        raise UserError(f"data.source={spec!r} needs the Hugging Face `datasets` package: "
                        "pip install datasets") from None
    try:
        dsd = datasets.load_dataset(name, config_name or None)
    except Exception as exc:  # network, missing dataset, bad config: all user-fixable
        if not online:
            raise UserError(f"data.source={spec!r}: not in the local Hugging Face cache and {why}; load it once on a "
                            "machine with network (same HF_HOME), or save it as .jsonl/.parquet and give that "
                            "path") from None
        raise UserError(f"data.source={spec!r}: could not load the dataset ({exc.__class__.__name__}: {exc})") from None
    for split_name, ds in dsd.items():
        for i, record in enumerate(ds):
            loc = f"{spec}[{split_name}] row {i}"
            text = _field(record, cfg.text_field, "text", loc)
            label = _field(record, cfg.label_field, "label", loc)
            yield f"{split_name}:{i}:{text}", text, label, loc


def rows_for(cfg: DataConfig) -> tuple[str, Iterator[Row]]:
    """The source's name and its rows (:data:`Row`), read lazily by the reader for ``data.source``: WordNet, a
    Hugging Face dataset (``hf:``) or a .jsonl/.csv/.parquet file. Raises UserError: no such file, a directory, or
    an unsupported file type."""
    src = cfg.source
    if src == "wordnet":
        return "wordnet", _wordnet_rows(cfg)
    if src.startswith("hf:"):
        return src, _hf_rows(src, cfg)
    path = Path(src)
    if path.is_dir():
        raise UserError(f"data.source={src!r} is a directory; give one .jsonl/.csv/.parquet file in it")
    if not path.is_file():
        raise UserError(f"data.source={src!r}: no such file; give a .jsonl/.csv/.parquet path, 'wordnet' or "
                        "'hf:NAME[:CONFIG]'")
    readers = {".jsonl": _jsonl_rows, ".json": _jsonl_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise UserError(f"data.source={src!r}: unsupported file type {path.suffix!r}; use .jsonl, .csv or .parquet")
    return path.name, reader(path, cfg)

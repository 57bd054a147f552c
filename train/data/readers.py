"""The source readers behind :func:`train.data.sources.scan_source`: built-in WordNet, JSONL, CSV, Parquet and
Hugging Face datasets, each yielding ``(key, text, raw_label, location)`` rows (validated and split by the caller)."""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

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


def jsonl_records(path: Path, expect: str,
                  on_blank: Optional[Callable[[str], None]] = None) -> Iterator[tuple[dict, str]]:
    """``(record, "file:line")`` for each non-blank line of a JSONL file; ``expect`` says what a record holds (for
    the message when a line is JSON but not an object); ``on_blank("file:line")`` for each blank line skipped
    (without it, one ``note:`` line on stderr says how many).

    Raises:
        UserError: a line that is not UTF-8, not JSON or not an object (file:line).
    """
    blank: list[str] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            loc = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is not data
            except UnicodeDecodeError as exc:
                raise UserError(f"{loc}: not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
            if not line.strip():
                (on_blank or blank.append)(loc)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{loc}: malformed JSON ({exc.msg} at column {exc.colno}); "
                                "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise UserError(f"{loc}: expected a JSON object with {expect}")
            yield record, loc
    blank_note(path, blank)


def blank_note(path: Path, blank: list[str]) -> None:
    """One ``note:`` line on stderr for the blank lines (their ``file:line``) a reader skipped; none without any."""
    if blank:
        print(f"note: {path}: {len(blank)} blank line{'s' if len(blank) > 1 else ''} skipped (first: {blank[0]})",
              file=sys.stderr, flush=True)


def _jsonl_rows(path: Path, cfg: DataConfig, on_blank: Optional[Callable[[str], None]] = None) -> Iterator[Row]:
    for record, loc in jsonl_records(path, f"{cfg.text_field!r} and {cfg.label_field!r}", on_blank):
        text = _field(record, cfg.text_field, "text", loc)
        label = _field(record, cfg.label_field, "label", loc)
        yield str(text) if text is not None else "", text, label, loc


_INT = re.compile(r"[-+]?[0-9]+")  # ASCII digits only (str.isdigit accepts '²')
_FLOAT = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][-+]?[0-9]+)?")


def decoded_lines(path: Path, f) -> Iterator[str]:
    """The lines of the binary file ``f`` (``path``) as text, line endings kept (``\\n``, ``\\r\\n``, ``\\r``), each
    decoded on its own so an error names its line (a leading BOM is not data).

    Raises:
        UserError: a line that is not UTF-8, or holds a NUL character (``file:line``).
    """
    lineno = 0
    for raw in f:
        for piece in raw.splitlines(keepends=True):  # a lone \\r ends a line too, as in text mode
            lineno += 1
            try:
                line = piece.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start + 1} of the line); re-encode the "
                                "file as UTF-8") from None
            if "\0" in line:  # most often a UTF-16 file read as UTF-8; never text a model should learn
                raise UserError(f"{path}:{lineno}: a NUL character (column {line.index(chr(0)) + 1}); a UTF-16 or "
                                "binary file? save it as UTF-8 text, or remove the NUL characters")
            yield line


def csv_records(path: Path, check_header: Callable[[list[str]], None],
                on_blank: Optional[Callable[[str], None]] = None) -> Iterator[tuple[dict, str]]:
    """``(record, "file:line")`` for each row of a CSV file (UTF-8, a header line); ``check_header(columns)`` raises
    for missing columns before the first row; ``on_blank("file:line")`` for each blank line skipped (without it,
    one ``note:`` line on stderr says how many).

    Raises:
        UserError: not UTF-8 or a NUL character (file:line), malformed CSV, a row with another number of columns
            than the header.
    """
    blank: list[str] = []
    try:
        with open(path, "rb") as f:
            reader = csv.reader(decoded_lines(path, f))
            header = next(reader, [])
            check_header(list(header))
            for row in reader:
                loc = f"{path}:{reader.line_num}"
                if not row:
                    (on_blank or blank.append)(loc)
                    continue
                if len(row) != len(header):
                    raise UserError(f"{loc}: expected {len(header)} columns as in the header, got a different count")
                yield dict(zip(header, row)), loc
    except csv.Error as exc:
        raise UserError(f"{path}: malformed CSV ({exc})") from None
    blank_note(path, blank)


def _csv_rows(path: Path, cfg: DataConfig, on_blank: Optional[Callable[[str], None]] = None) -> Iterator[Row]:
    def check_header(header: list[str]) -> None:
        for name, what in ((cfg.text_field, "text"), (cfg.label_field, "label")):
            if name not in header:
                raise UserError(f"{path}:1: no {what} column {name!r} (columns: {', '.join(header) or 'none'}); "
                                f"set data.{what}_field to the right name")

    for record, loc in csv_records(path, check_header, on_blank):
        label: Any = record[cfg.label_field].strip()
        if _INT.fullmatch(label):
            label = int(label)
        elif _FLOAT.fullmatch(label):  # as the JSONL reader: a classifier's label is a class id or a name
            raise UserError(f"{loc}: label {label!r} must be a string or an integer "
                            "(a float label: use integer class ids 0..K-1 or class names)")
        yield record[cfg.text_field], record[cfg.text_field], label, loc


def parquet_columns(path: Path, wanted: list[str], check: Callable[[list[str]], None]) -> dict[str, list]:
    """The columns of ``wanted`` that the Parquet file has, as lists; ``check(columns)`` raises for missing ones.

    Raises:
        UserError: not a readable Parquet file.
    """
    import pyarrow.parquet as pq

    try:
        schema_names = pq.read_schema(path).names
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise UserError(f"{path}: not a readable Parquet file ({exc.__class__.__name__}: {exc})") from None
    check(list(schema_names))
    present = [name for name in wanted if name in schema_names]
    table = pq.read_table(path, columns=present)
    return {name: table.column(name).to_pylist() for name in present}


def _parquet_rows(path: Path, cfg: DataConfig, on_blank: Optional[Callable[[str], None]] = None) -> Iterator[Row]:
    def check(schema_names: list[str]) -> None:
        for name, what in ((cfg.text_field, "text"), (cfg.label_field, "label")):
            if name not in schema_names:
                raise UserError(f"{path}: no {what} column {name!r} (columns: {', '.join(schema_names)}); "
                                f"set data.{what}_field")

    columns = parquet_columns(path, [cfg.text_field, cfg.label_field], check)
    texts, labels = columns[cfg.text_field], columns[cfg.label_field]
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


def hf_records(spec: str) -> Iterator[tuple[str, int, dict, str]]:
    """``(split name, row number, record, location)`` for each row of every split of the Hugging Face dataset
    ``hf:NAME[:CONFIG]`` (offline, from the local cache, when the Hub cannot be reached).

    Raises:
        UserError: ``datasets`` missing, the dataset not cached offline, or it cannot be loaded.
    """
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
            yield split_name, i, record, f"{spec}[{split_name}] row {i}"


def _hf_rows(spec: str, cfg: DataConfig) -> Iterator[Row]:
    for split_name, i, record, loc in hf_records(spec):
        text = _field(record, cfg.text_field, "text", loc)
        label = _field(record, cfg.label_field, "label", loc)
        yield f"{split_name}:{i}:{text}", text, label, loc


def source_rows(cfg: DataConfig, wordnet_rows: Callable[[DataConfig], Iterator],
                hf_rows: Callable[[str, DataConfig], Iterator],
                file_rows: Callable[[Path, DataConfig], Iterator]) -> tuple[str, Iterator]:
    """The source's name and the rows of the reader for ``data.source``: ``wordnet_rows(cfg)``, ``hf_rows(spec, cfg)``
    for ``hf:``, or ``file_rows(path, cfg)`` for a .jsonl/.csv/.parquet file (it picks by ``path.suffix``).

    Raises:
        UserError: no such file, a directory, or an unsupported file type.
    """
    src = cfg.source
    if src == "wordnet":
        return "wordnet", wordnet_rows(cfg)
    if src.startswith("hf:"):
        return src, hf_rows(src, cfg)
    path = Path(src)
    if path.is_dir():
        raise UserError(f"data.source={src!r} is a directory; give one .jsonl/.csv/.parquet file in it")
    if not path.is_file():
        raise UserError(f"data.source={src!r}: no such file; give a .jsonl/.csv/.parquet path, 'wordnet' or "
                        "'hf:NAME[:CONFIG]'")
    if path.suffix.lower() not in FILE_TYPES:
        raise UserError(f"data.source={src!r}: unsupported file type {path.suffix!r}; use .jsonl, .csv or .parquet")
    return path.name, file_rows(path, cfg)


FILE_TYPES = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
"""File suffix → format."""


def rows_for(cfg: DataConfig, on_blank: Optional[Callable[[str], None]] = None) -> tuple[str, Iterator[Row]]:
    """The source's name and its rows (:data:`Row`), read lazily by the reader for ``data.source``: WordNet, a
    Hugging Face dataset (``hf:``) or a .jsonl/.csv/.parquet file; ``on_blank("file:line")`` for each blank line a
    JSONL/CSV file skips (without it, one ``note:`` line on stderr). Raises UserError: no such file, a directory, or
    an unsupported file type."""
    readers = {"jsonl": _jsonl_rows, "csv": _csv_rows, "parquet": _parquet_rows}
    return source_rows(cfg, _wordnet_rows, _hf_rows,
                       lambda path, c: readers[FILE_TYPES[path.suffix.lower()]](path, c, on_blank))

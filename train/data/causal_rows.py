"""Rows for ``model.task=causal-lm``: the same sources as classification (WordNet, JSONL, CSV, Parquet, Hugging Face
datasets), each row a ``text`` (every token after the first is a target) or a ``prompt`` + ``completion`` (the loss
on the completion's tokens and the EOS after it only); ``data.source=wordnet`` gives each synset's gloss as a text row.

A row is kept compact through preparation as one string, ``prompt + completion`` (a text row: its text, an empty
prompt), and the prompt's length in characters (the scan's ``labels``); train/data/causal_prepare.py tokenizes the two
parts apart, so the first completion token starts exactly after the prompt's tokens. Splits are the classification
ones: the same stable hash (:func:`~train.data.sources.split_rows`), of the synset (WordNet) or of the row's content.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np

import train.data.wordnet as wordnet  # the module itself, not the package: no package <-> submodule import loop
from train.config import DataConfig
from train.data.readers import FILE_TYPES, csv_records, hf_records, jsonl_records, parquet_columns, source_rows
from train.data.sources import Scan, split_rows, stable_fraction
from train.errors import UserError

LMRow = tuple[str, str, str, str]
"""``(split key, prompt, completion, location)``; a text row: an empty prompt and its text as the completion."""


def fields_fix(cfg: DataConfig) -> str:
    return (f"model.task=causal-lm reads text rows ({cfg.text_field!r}) or prompt + completion rows "
            f"({cfg.prompt_field!r} + {cfg.completion_field!r}): set data.text_field, or data.prompt_field and "
            "data.completion_field, to the right names")


def lm_row(record: dict, cfg: DataConfig, loc: str, blank_is_missing: bool = False) -> tuple[str, str]:
    """``(prompt, completion)`` of one record (a text row: ``("", text)``). A field is given when the record has it
    and it is not null (``blank_is_missing``: nor an empty CSV cell).

    Raises:
        UserError: neither a text nor a completion, both, a prompt without a completion, a value that is not a
            string, an empty text or completion (one line naming ``loc`` and the fix).
    """
    def given(name: str) -> bool:
        v = record.get(name)
        return v is not None and not (blank_is_missing and v == "")

    tf, pf, cf = cfg.text_field, cfg.prompt_field, cfg.completion_field
    pair, text = given(pf) or given(cf), given(tf)
    if pair and text:
        raise UserError(f"{loc}: both a text ({tf!r}) and a prompt/completion ({pf!r}, {cf!r}); give a row one "
                        "or the other")
    if not pair and not text and isinstance(record.get(tf), str):  # an empty CSV cell where the text belongs
        return "", _string(record[tf], tf, "text", loc)
    if not pair and not text:
        have = ", ".join(map(str, record)) or "none"
        raise UserError(f"{loc}: neither a text field {tf!r} nor a completion field {cf!r} (fields: {have}); "
                        + fields_fix(cfg))
    if text:
        return "", _string(record[tf], tf, "text", loc)
    if not given(cf):
        raise UserError(f"{loc}: a prompt without a completion ({cf!r} missing); add the completion the model "
                        "should learn, or give the row as a text")
    prompt = _string(record[pf], pf, "prompt", loc) if given(pf) else ""
    return prompt, _string(record[cf], cf, "completion", loc)


def _string(value: Any, field: str, what: str, loc: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{loc}: {what} ({field!r}) must be a string, got {type(value).__name__}")
    if what != "prompt" and not value.strip():
        fix = "remove the row or fill in" if what == "text" else "the model learns the completion: fill in"
        raise UserError(f"{loc}: empty {what}; {fix} {field!r}")
    return value


def row_key(prompt: str, completion: str) -> str:
    """The string a row's split is hashed from: its text (as classification), or prompt and completion."""
    return f"{prompt}\0{completion}" if prompt else completion


def _wordnet_rows(cfg: DataConfig) -> Iterator[LMRow]:
    root = wordnet.find_wordnet_dir(cfg.wordnet_dir)
    for s in wordnet.iter_synsets(root):
        if s.gloss.strip():
            yield f"{s.pos}:{s.offset}", "", s.gloss, f"{root} synset {s.pos}:{s.offset:08d}"


def _forms_check(cfg: DataConfig, where: str) -> Callable[[list[str]], None]:
    def check(columns: list[str]) -> None:
        if cfg.text_field not in columns and not {cfg.prompt_field, cfg.completion_field} <= set(columns):
            raise UserError(f"{where}: no text column {cfg.text_field!r} and no {cfg.prompt_field!r} + "
                            f"{cfg.completion_field!r} columns (columns: {', '.join(columns) or 'none'}); "
                            + fields_fix(cfg))
    return check


def _file_rows(path: Path, cfg: DataConfig) -> Iterator[LMRow]:
    kind = FILE_TYPES[path.suffix.lower()]
    records: Iterator[tuple[dict, str]]
    if kind == "jsonl":
        records = jsonl_records(path, f"{cfg.text_field!r}, or {cfg.prompt_field!r} and {cfg.completion_field!r}")
    elif kind == "csv":
        records = csv_records(path, _forms_check(cfg, f"{path}:1"))
    else:
        names = [cfg.text_field, cfg.prompt_field, cfg.completion_field]
        columns = parquet_columns(path, names, _forms_check(cfg, str(path)))
        n = len(next(iter(columns.values()))) if columns else 0
        records = (({k: v[i] for k, v in columns.items()}, f"{path}: row {i}") for i in range(n))
    for record, loc in records:
        prompt, completion = lm_row(record, cfg, loc, blank_is_missing=kind == "csv")
        yield row_key(prompt, completion), prompt, completion, loc


def _hf_rows(spec: str, cfg: DataConfig) -> Iterator[LMRow]:
    for split_name, i, record, loc in hf_records(spec):
        prompt, completion = lm_row(record, cfg, loc)
        yield f"{split_name}:{i}:{row_key(prompt, completion)}", prompt, completion, loc


def lm_rows_for(cfg: DataConfig) -> tuple[str, Iterator[LMRow]]:
    """The source's name and its causal-LM rows (:data:`LMRow`), read lazily.

    Raises:
        UserError: as :func:`~train.data.readers.rows_for`, and a row of neither form (:func:`lm_row`).
    """
    return source_rows(cfg, _wordnet_rows, _hf_rows, _file_rows)


def scan_lm_source(cfg: DataConfig, on_text: Callable[[str], None],
                   progress: Optional[Callable[[int], None]] = None) -> Scan:
    """:func:`~train.data.sources.scan_source` for causal-LM rows: each row's ``prompt + completion`` handed to
    ``on_text``; ``labels`` holds each row's prompt length in characters (int64; 0 for a text row) and
    ``label_names`` is empty.

    Raises:
        UserError: as :func:`lm_rows_for`; no rows; an empty training split.
    """
    name, rows = lm_rows_for(cfg)
    fractions, prompt_chars = array("d"), array("q")
    done = 0
    for key, prompt, completion, _loc in rows:
        fractions.append(stable_fraction(key))
        prompt_chars.append(len(prompt))
        on_text(prompt + completion)
        if progress is not None and len(fractions) - done >= 65536:
            progress(len(fractions) - done)
            done = len(fractions)
    if progress is not None and len(fractions) > done:
        progress(len(fractions) - done)
    if not fractions:
        raise UserError(f"data.source={cfg.source!r}: no examples found")
    labels = np.frombuffer(prompt_chars, dtype=np.int64).copy()
    return Scan(name=name, label_names=[], labels=labels, splits=split_rows(fractions, cfg), rows=len(fractions))


def lm_row_location(cfg: DataConfig, i: int) -> str:
    """Where row ``i`` (in the order :func:`lm_rows_for` yields them) is, for a message: the source read again."""
    name, rows = lm_rows_for(cfg)
    for k, row in enumerate(rows):
        if k == i:
            return row[3]
    return f"{name}: row {i}"

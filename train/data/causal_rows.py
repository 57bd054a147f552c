"""Rows for ``model.task=causal-lm``: the same sources as classification (WordNet, JSONL, CSV, Parquet, Hugging Face
datasets), each row a ``text`` (every token after the first is a target), a ``prompt`` + ``completion`` (the loss
on the completion's tokens and the EOS after it only) or a chat row's ``messages`` (rendered with the model's chat
template into a prompt + completion: train/data/chat.py); ``data.source=wordnet`` gives each synset's gloss as a text
row, or with ``data.wordnet_format=chat`` as the answer to ``Define <word>.``.

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
from train.data.chat import chat_template_for
from train.data.data_policy import DropLog, nothing_left, refusal
from train.data.readers import FILE_TYPES, csv_records, hf_records, jsonl_records, parquet_columns, source_rows
from train.data.sources import Scan, split_rows, stable_fraction
from train.errors import UserError

LMRow = tuple[str, str, str, str, Optional[str]]
"""``(split key, prompt, completion, location, drop cause)``; a text row: an empty prompt and its text as the
completion. The cause (a key of :data:`train.data.data_policy.WHY`) is None for a row to train on."""


def fields_fix(cfg: DataConfig) -> str:
    return (f"model.task=causal-lm reads text rows ({cfg.text_field!r}), prompt + completion rows "
            f"({cfg.prompt_field!r} + {cfg.completion_field!r}) or chat rows ({cfg.messages_field!r}): set "
            "data.text_field, data.prompt_field and data.completion_field, or data.messages_field to the right names")


def lm_row(record: dict, cfg: DataConfig, loc: str, blank_is_missing: bool = False) -> tuple[str, str, Optional[str]]:
    """``(prompt, completion, drop cause)`` of one record (a text row: ``("", text, cause)``); the cause is
    ``empty_text`` / ``empty_completion`` for one of only whitespace (a row to drop or refuse by
    ``data.on_bad_row``), else None. A field is given when the record has it and it is not null
    (``blank_is_missing``: nor an empty CSV cell).

    Raises:
        UserError: neither a text nor a completion, both, a prompt without a completion, a value that is not a
            string (one line naming ``loc`` and the fix).
    """
    def given(name: str) -> bool:
        v = record.get(name)
        return v is not None and not (blank_is_missing and v == "")

    tf, pf, cf = cfg.text_field, cfg.prompt_field, cfg.completion_field
    pair, text = given(pf) or given(cf), given(tf)
    if given(cfg.messages_field):
        if pair or text:
            raise UserError(f"{loc}: both a conversation ({cfg.messages_field!r}) and a text or prompt/completion; "
                            "give a row one of them")
        return chat_template_for(cfg.tokenizer_path).split(record[cfg.messages_field], loc)
    if pair and text:
        raise UserError(f"{loc}: both a text ({tf!r}) and a prompt/completion ({pf!r}, {cf!r}); give a row one "
                        "or the other")
    if not pair and not text and isinstance(record.get(tf), str):  # an empty CSV cell where the text belongs
        return "", record[tf], "empty_text"
    if not pair and not text:
        have = ", ".join(map(str, record)) or "none"
        raise UserError(f"{loc}: neither a text field {tf!r} nor a completion field {cf!r} (fields: {have}); "
                        + fields_fix(cfg))
    if text:
        value = _string(record[tf], tf, "text", loc)
        return "", value, None if value.strip() else "empty_text"
    if not given(cf):
        raise UserError(f"{loc}: a prompt without a completion ({cf!r} missing); add the completion the model "
                        "should learn, or give the row as a text")
    prompt = _string(record[pf], pf, "prompt", loc) if given(pf) else ""
    completion = _string(record[cf], cf, "completion", loc)
    return prompt, completion, None if completion.strip() else "empty_completion"


def _string(value: Any, field: str, what: str, loc: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{loc}: {what} ({field!r}) must be a string, got {type(value).__name__}")
    return value


def row_key(prompt: str, completion: str) -> str:
    """The string a row's split is hashed from: its text (as classification), or prompt and completion."""
    return f"{prompt}\0{completion}" if prompt else completion


def _wordnet_rows(cfg: DataConfig) -> Iterator[LMRow]:
    root = wordnet.find_wordnet_dir(cfg.wordnet_dir)
    chat = chat_template_for(cfg.tokenizer_path) if cfg.wordnet_format == "chat" else None
    for s in wordnet.iter_synsets(root):
        if not s.gloss.strip():
            continue
        loc = f"{root} synset {s.pos}:{s.offset:08d}"
        if chat is None:
            yield f"{s.pos}:{s.offset}", "", s.gloss, loc, None
            continue
        prompt, completion, cause = chat.split(wordnet_chat(s), loc)
        yield f"{s.pos}:{s.offset}", prompt, completion, loc, cause


def wordnet_chat(s: wordnet.Synset) -> list[dict[str, str]]:
    """A synset as a conversation: the user asks ``Define <its first word>.``, the assistant answers the gloss."""
    word = s.lemmas[0].replace("_", " ") if s.lemmas else ""
    return [{"role": "user", "content": f"Define {word}."}, {"role": "assistant", "content": s.gloss.strip()}]


def _forms_check(cfg: DataConfig, where: str) -> Callable[[list[str]], None]:
    def check(columns: list[str]) -> None:
        if cfg.text_field not in columns and not {cfg.prompt_field, cfg.completion_field} <= set(columns):
            raise UserError(f"{where}: no text column {cfg.text_field!r} and no {cfg.prompt_field!r} + "
                            f"{cfg.completion_field!r} columns (columns: {', '.join(columns) or 'none'}); "
                            + fields_fix(cfg))
    return check


def _file_rows(path: Path, cfg: DataConfig, on_blank: Optional[Callable[[str], None]]) -> Iterator[LMRow]:
    kind = FILE_TYPES[path.suffix.lower()]
    records: Iterator[tuple[dict, str]]
    if kind == "jsonl":
        records = jsonl_records(path, f"{cfg.text_field!r}, or {cfg.prompt_field!r} and {cfg.completion_field!r}",
                                on_blank)
    elif kind == "csv":
        records = csv_records(path, _forms_check(cfg, f"{path}:1"), on_blank)
    else:
        names = [cfg.text_field, cfg.prompt_field, cfg.completion_field]
        columns = parquet_columns(path, names, _forms_check(cfg, str(path)))
        n = len(next(iter(columns.values()))) if columns else 0
        records = (({k: v[i] for k, v in columns.items()}, f"{path}: row {i}") for i in range(n))
    for record, loc in records:
        prompt, completion, cause = lm_row(record, cfg, loc, blank_is_missing=kind == "csv")
        yield row_key(prompt, completion), prompt, completion, loc, cause


def _hf_rows(spec: str, cfg: DataConfig) -> Iterator[LMRow]:
    for split_name, i, record, loc in hf_records(spec):
        prompt, completion, cause = lm_row(record, cfg, loc)
        yield f"{split_name}:{i}:{row_key(prompt, completion)}", prompt, completion, loc, cause


def lm_rows_for(cfg: DataConfig, on_blank: Optional[Callable[[str], None]] = None) -> tuple[str, Iterator[LMRow]]:
    """The source's name and its causal-LM rows (:data:`LMRow`), read lazily; ``on_blank("file:line")`` for each
    blank line a JSONL/CSV file skips.

    Raises:
        UserError: as :func:`~train.data.readers.rows_for`, and a row of neither form (:func:`lm_row`).
    """
    return source_rows(cfg, _wordnet_rows, _hf_rows, lambda path, c: _file_rows(path, c, on_blank))


def scan_lm_source(cfg: DataConfig, on_text: Callable[[str], None],
                   progress: Optional[Callable[[int], None]] = None, log: Optional[DropLog] = None) -> Scan:
    """:func:`~train.data.sources.scan_source` for causal-LM rows: each row's ``prompt + completion`` handed to
    ``on_text``; ``labels`` holds each row's prompt length in characters (int64; 0 for a text row) and
    ``label_names`` is empty. A row with a drop cause (an empty text or completion) and blank lines are left out
    and recorded in ``log``: the scan's rows are the rows kept.

    Raises:
        UserError: as :func:`lm_rows_for`; no rows; every row dropped; an empty training split.
    """
    log = log if log is not None else DropLog()
    name, rows = lm_rows_for(cfg, log.blank)
    fractions, prompt_chars = array("d"), array("q")
    done = 0
    for source_row, (key, prompt, completion, loc, cause) in enumerate(rows):
        if cause is not None:
            log.read_drop(source_row, cause, loc)
            continue
        fractions.append(stable_fraction(key))
        prompt_chars.append(len(prompt))
        on_text(prompt + completion)
        if progress is not None and len(fractions) - done >= 65536:
            progress(len(fractions) - done)
            done = len(fractions)
    if progress is not None and len(fractions) > done:
        progress(len(fractions) - done)
    if not fractions and log.total:
        raise (refusal(sorted(log.early), log.total, cfg.max_len) if cfg.on_bad_row == "error"
               else nothing_left(log.counts, f"data.source={cfg.source!r}", cfg.max_len, first=sorted(log.early)))
    if not fractions:
        raise UserError(f"data.source={cfg.source!r}: no examples found")
    labels = np.frombuffer(prompt_chars, dtype=np.int64).copy()
    return Scan(name=name, label_names=[], labels=labels, splits=split_rows(fractions, cfg), rows=len(fractions))


def lm_row_locations(cfg: DataConfig, scan_rows: set[int]) -> dict[int, tuple[int, str]]:
    """Where the scan's rows ``scan_rows`` (numbered as :func:`scan_lm_source` keeps them) are, for a message:
    ``{scan row: (source row, location)}``, the source read again once."""
    _name, rows = lm_rows_for(cfg)
    found: dict[int, tuple[int, str]] = {}
    kept = -1
    for source_row, row in enumerate(rows):
        if row[4] is not None:
            continue
        kept += 1
        if kept in scan_rows:
            found[kept] = (source_row, row[3])
            if len(found) == len(scan_rows):
                break
    return found

"""A decoder's data as users bring it (issue 61): rows a model cannot learn from dropped and counted by cause, or
refused all at once (``data.on_bad_row``); long texts truncated or split (``data.long_text``), said in one line; no
training row left, or a ``batching.pack_len`` that leaves none a target, refused in one line before any step; packed
rows never without a target; every drop in report.json; a CSV's bad bytes, NULs and blank lines named by line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import assert_clean_error, run_cli, tiny_overrides, word_tokenizer, write_jsonl
from tests.conftest import causal_cfg as cfg_for
from train.config import DataConfig, load_config
from train.data.causal_collate import causal_targets
from train.data.causal_prepare import text_pieces
from train.data.causal_rows import lm_rows_for
from train.data.readers import csv_records, jsonl_records
from train.errors import UserError

PROMPT = " ".join(["q"] * 10)  # 10 tokens with the word tokenizer (no BOS): 13 with " a b" and EOS


def word_tok(tmp_path: Path) -> str:
    """A saved word-level tokenizer (EOS ``</s>`` found by name): one token per word, so lengths are exact."""
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir(exist_ok=True)
    word_tokenizer().save(str(path))
    return f"data.tokenizer_path={path}"


def prepare(tmp_path: Path, rows: list, *overrides: str):
    """``prepare_data`` of ``rows`` (a JSONL file) with the word tokenizer; (bundle, the console lines)."""
    from train.data import prepare_data

    said: list[str] = []
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    bundle = prepare_data(cfg_for(tmp_path, f"data.source={src}", word_tok(tmp_path), *overrides), notice=said.append)
    return bundle, said


def refused(tmp_path: Path, rows: list, *overrides: str) -> str:
    with pytest.raises(UserError) as info:
        prepare(tmp_path, rows, *overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def good(i: int) -> dict:
    return {"prompt": f"what is {'abcde'[i % 5]}", "completion": " the answer"}


# -- 1: every row without a target ---------------------------------------------------------------------------------

def test_every_row_without_a_target_is_one_line_exit_2_and_no_run_directory(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": " ".join(["q"] * 15), "completion": " a"}] * 30)
    proc = run_cli("train", *tiny_overrides(tmp_path, tmp_path, "model.task=causal-lm", "data.max_len=16",
                                            f"data.source={src}", word_tok(tmp_path), "train.run_id=x"))
    assert_clean_error(proc, "no training row is left with a target to train on (dropped: 30 no completion token "
                       f"fits after the prompt in data.max_len=16; first: {src}:1, {src}:2, {src}:3)")
    assert proc.stderr.count("\n") == 1
    assert not (tmp_path / "runs" / "x").exists()


# -- 2 and 8: packed rows of batching.pack_len ---------------------------------------------------------------------

def test_a_pack_len_shorter_than_every_prompt_is_refused_naming_it(tmp_path: Path) -> None:
    msg = refused(tmp_path, [{"prompt": PROMPT, "completion": " a b"}] * 40, "batching.method=packed",
                  "batching.pack_len=8")
    assert msg.startswith("batching.pack_len=8: no training row is left with a target to train on (dropped: 40 no "
                          "completion token fits after the prompt in batching.pack_len=8)")
    assert msg.endswith("raise batching.pack_len (or null: data.max_len)")


def test_packed_rows_without_a_target_are_not_built(tmp_path: Path) -> None:
    from train.data import make_loader

    rows = [{"prompt": PROMPT, "completion": " a b"} if i % 2 else good(i) for i in range(120)]
    overrides = ("batching.method=packed", "batching.pack_len=8", "batching.max_tokens=16")
    bundle, said = prepare(tmp_path, rows, *overrides)
    heavy = bundle.data_facts["dropped_rows"]["no_target_at_pack_len"]
    assert heavy > 0 and len(bundle.splits["train"]) + heavy == len(bundle.corpus.train)
    assert [line.split(":")[1] for line in said if line.startswith("warning:")] == \
        [f" {heavy} rows dropped, nothing to learn from them"]
    cfg = cfg_for(tmp_path, f"data.source={tmp_path / 'd.jsonl'}", word_tok(tmp_path), *overrides)
    batches = list(make_loader(bundle, "train", cfg, True, torch.device("cpu")))
    assert batches and all(b["target_tokens"] > 0 for b in batches)  # no optimizer step trains nothing


# -- 3: data.on_bad_row --------------------------------------------------------------------------------------------

def bad_rows() -> list:
    """Whitespace-only completions on lines 6, 16, …, 116; prompts longer than max_len=16 on lines 31, 53, 77, 99."""
    rows: list = [good(i) for i in range(120)]
    for line in range(6, 121, 10):
        rows[line - 1] = {"prompt": "q", "completion": "  "}
    for line in (31, 53, 77, 99):
        rows[line - 1] = {"prompt": " ".join(["q"] * 20), "completion": " a"}
    return rows


def test_on_bad_row_drop_counts_each_cause_and_names_the_first_lines_in_file_order(tmp_path: Path) -> None:
    bundle, said = prepare(tmp_path, bad_rows())
    src = tmp_path / "d.jsonl"
    assert bundle.data_facts["dropped_rows"] == {"empty_completion": 12, "prompt_too_long": 4}
    assert bundle.data_facts["dropped_rows_first"] == {"empty_completion": [f"{src}:6", f"{src}:16", f"{src}:26"],
                                                       "prompt_too_long": [f"{src}:31", f"{src}:53", f"{src}:77"]}
    warning = [line for line in said if line.startswith("warning:")]
    assert len(warning) == 1 and "16 rows dropped" in warning[0] and f"({src}:31, {src}:53, {src}:77, …)" in warning[0]
    assert sum(len(s) for s in bundle.splits.values()) == 120 - 16


def test_on_bad_row_error_lists_every_offending_line_at_once(tmp_path: Path) -> None:
    msg = refused(tmp_path, bad_rows(), "data.on_bad_row=error")
    src = tmp_path / "d.jsonl"
    assert msg.startswith("16 rows a model cannot learn from (the first 10 of 16): ")
    named = [int(n) for n in re.findall(rf"{re.escape(str(src))}:(\d+): ", msg)]
    assert named == [6, 16, 26, 31, 36, 46, 53, 56, 66, 76]
    assert f"{src}:31: prompt longer than data.max_len=16" in msg and "data.on_bad_row=drop" in msg
    assert not list((tmp_path / "cache" / "data").iterdir())  # nothing half-written


# -- 4: data.long_text ---------------------------------------------------------------------------------------------

LONG = {"text": " ".join(["a"] * 100)}  # 100 tokens + EOS


def test_long_text_truncate_says_the_tokens_dropped(tmp_path: Path) -> None:
    bundle, said = prepare(tmp_path, [LONG] + [good(i) for i in range(40)])
    assert bundle.data_facts["truncated_tokens"] == 101 - 16
    assert "note: data.long_text=truncate: 1 sample longer than data.max_len=16 cut to it, 85 tokens dropped" in said[0]


def test_long_text_split_makes_max_len_samples_every_token_a_target_once(tmp_path: Path) -> None:
    seq = list(range(101))
    pieces = text_pieces(seq, 16)
    assert all(2 <= len(p) <= 16 for p in pieces)
    targets = np.concatenate([causal_targets(np.array(p), 0) for p in pieces])
    assert targets[targets >= 0].tolist() == seq[1:]  # each token after the first predicted exactly once
    rows = [LONG] + [good(i) for i in range(40)]
    bundle, said = prepare(tmp_path, rows, "data.long_text=split")
    assert bundle.data_facts["split_chunks"] == len(pieces) and bundle.data_facts["truncated_tokens"] == 0
    assert sum(len(s) for s in bundle.splits.values()) == len(rows) - 1 + len(pieces)
    assert all(len(bundle.corpus.split(k)) == len(s) for k, s in bundle.splits.items())  # texts sample for sample
    assert f"note: data.long_text=split: 1 text longer than data.max_len=16 split into {len(pieces)} samples" in said
    truncated, _ = prepare(tmp_path, rows)
    assert truncated.data_fingerprint != bundle.data_fingerprint  # a bucket plan of one does not pass for the other


def test_long_text_split_is_refused_for_a_classifier() -> None:
    with pytest.raises(UserError, match=r"data\.long_text=split .* model\.task=classification .* "
                                        r"data\.long_text=truncate"):
        load_config(None, ["data.long_text=split"])
    with pytest.raises(UserError, match=r"data\.on_bad_row='skip' is not one of drop, error"):
        load_config(None, ["data.on_bad_row=skip"])


# -- 5: report.json ------------------------------------------------------------------------------------------------

def test_report_json_counts_every_drop_and_cut_by_cause(tmp_path: Path) -> None:
    from train.run.training import run_training

    rows = bad_rows() + [LONG]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    llama = ("model.hf_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 4, "
             "intermediate_size: 64}")
    cfg = load_config(None, tiny_overrides(tmp_path, tmp_path, "model.task=causal-lm", "model.source=hf:llama", llama,
                                           f"data.source={src}", word_tok(tmp_path), "data.max_len=16",
                                           "batching.method=packed", "batching.max_tokens=64", "model.dropout=0.0",
                                           "model.packed_attention=sdpa-mask", "model.chunked_loss=false",
                                           "train.max_steps=2", "train.run_id=r"))
    report = run_training(cfg, time.perf_counter())
    data = json.loads((tmp_path / "runs" / "r" / "report.json").read_text())["data"]
    assert data == report["data"]
    assert data["dropped_rows"] == {"empty_completion": 12, "prompt_too_long": 4}
    assert data["dropped_rows_first"]["prompt_too_long"][0] == f"{src}:31"
    assert (data["on_bad_row"], data["long_text"], data["truncated_tokens"]) == ("drop", "truncate", 101 - 16)
    assert data["truncated_samples"] == 1 and data["blank_lines_skipped"] == 0


# -- 10: CSV lines -------------------------------------------------------------------------------------------------

def test_csv_invalid_utf8_names_its_line(tmp_path: Path) -> None:
    p = tmp_path / "d.csv"
    p.write_bytes(b"text,label\n" + b"".join(b"row %d,a\n" % i for i in range(39999)) + b"caf\xe9,b\n")
    with pytest.raises(UserError, match=rf"^{p}:40001: not valid UTF-8 \(byte 4 of the line\); re-encode"):
        list(csv_records(p, lambda _h: None))


def test_csv_nul_is_refused_naming_its_line(tmp_path: Path) -> None:
    p = tmp_path / "d.csv"
    p.write_bytes(b"text,label\nfine,a\nbad\x00row,b\n")
    with pytest.raises(UserError, match=rf"^{p}:3: a NUL character \(column 4\)"):
        list(csv_records(p, lambda _h: None))


def test_csv_blank_lines_are_counted_and_said(tmp_path: Path, capsys) -> None:
    p = tmp_path / "d.csv"
    p.write_text("text,label\nx,a\n\ny,b\n\r\nz,c\n", encoding="utf-8")
    assert [loc for _r, loc in csv_records(p, lambda _h: None)] == [f"{p}:2", f"{p}:4", f"{p}:6"]
    assert capsys.readouterr().err == f"note: {p}: 2 blank lines skipped (first: {p}:3)\n"
    j = write_jsonl(tmp_path / "d.jsonl", [{"text": "x", "label": "a"}, "", {"text": "y", "label": "b"}])
    assert len(list(jsonl_records(j, "text"))) == 2
    assert capsys.readouterr().err == f"note: {j}: 1 blank line skipped (first: {j}:2)\n"
    blank: list[str] = []
    rows = list(lm_rows_for(DataConfig(source=str(p)), blank.append)[1])
    assert len(rows) == 3 and blank == [f"{p}:3", f"{p}:5"]
    from train.data import prepare_data

    q = tmp_path / "lm.csv"
    q.write_text("text\n" + "".join(f"a b {'abcde'[i % 5]}\n" + ("\n" if i % 10 == 0 else "") for i in range(40)))
    said: list[str] = []
    bundle = prepare_data(cfg_for(tmp_path, f"data.source={q}", word_tok(tmp_path)), notice=said.append)
    assert bundle.data_facts["blank_lines_skipped"] == 4 and f"note: 4 blank lines skipped (first: {q}:3)" in said


def test_a_classifier_s_blank_lines_are_counted_in_its_prepared_data_and_said_once(tmp_path: Path, capsys) -> None:
    """A classifier's JSONL with blank lines: the count and the first line reach the prepared data's facts (report.json
    ``data.blank_lines_skipped``, ``data.first_blank_line``), and the note is printed once (a refusal's second read
    of the source prints none)."""
    from train.data import prepare_data

    rows: list = []
    for i in range(60):
        rows.append({"text": f"word {'abcde'[i % 5]} number {i}", "label": "xyz"[i % 3]})
        if i % 20 == 1:
            rows.append("")
    j = write_jsonl(tmp_path / "c.jsonl", rows)
    cfg = load_config(None, [f"data.source={j}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=64"])
    bundle = prepare_data(cfg, notice=lambda *_: None)
    assert bundle.data_facts["blank_lines_skipped"] == 3 and bundle.data_facts["first_blank_line"] == f"{j}:3"
    assert capsys.readouterr().err.count("blank lines skipped") == 1

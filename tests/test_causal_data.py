"""The data side of ``model.task=causal-lm`` (docs/models.md, "The causal-LM contract"): rows (text, prompt +
completion, WordNet glosses), the tokenizer (a model directory's roles; a deterministic, cached byte-level BPE), the
samples ``(ids, n_prompt)`` (EOS kept by truncation, drops counted), the padded and packed batches (shifted targets, no
off-by-one, never across a sample, padding never trained, EOS-as-pad masked by position), and each bad input's line."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests.conftest import WORDS, assert_clean_error, run_cli, word_tokenizer, write_jsonl
from tests.conftest import causal_cfg as cfg_for
from train.config import DataConfig, load_config
from train.data.causal_collate import (
    IGNORE_INDEX,
    CausalPackCollate,
    CausalPadCollate,
    causal_targets,
    pack_collate_for,
    pad_collate_for,
)
from train.data.causal_prepare import encode_lm_chunk
from train.data.causal_rows import lm_rows_for, scan_lm_source
from train.data.causal_tokenizer import EOT, MIN_BPE_VOCAB, Roles, load_or_train_lm, read_roles, train_bpe
from train.data.collate import PadCollate
from train.data.packing import PackCollate
from train.errors import UserError


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


# -- targets: per sample -----------------------------------------------------------------------------------------

def test_text_targets_every_next_token_and_the_eos() -> None:
    ids = np.array([5, 6, 7, 1])  # text tokens + EOS (no BOS)
    assert causal_targets(ids, 0).tolist() == [6, 7, 1, IGNORE_INDEX]


def test_prompt_completion_targets_start_at_the_first_completion_token() -> None:
    ids = np.array([0, 10, 11, 20, 21, 1])  # BOS, prompt 10 11, completion 20 21, EOS
    n_prompt = 3  # len([BOS] + prompt)
    labels = causal_targets(ids, n_prompt)
    assert labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 20, 21, 1, IGNORE_INDEX]
    assert labels[n_prompt - 1] == ids[n_prompt]  # the first completion token predicted from the last prompt token
    assert causal_targets(ids, 1).tolist() == causal_targets(ids, 0).tolist()  # empty prompt with BOS = a text


def test_encoding_a_text_and_a_pair_with_bos() -> None:
    tok = word_tokenizer(bos_template=True)
    roles = read_roles(tok, None, "tok")  # no role files: EOS by name (</s>), BOS not named: none
    assert (roles.eos_id, roles.bos_id, roles.pad_id, roles.pad_is_eos) == (1, None, 1, True)
    roles = Roles(eos_id=1, pad_id=1, bos_id=0, add_bos=True)
    prompt, completion = "what is two plus two", " four"
    chunk = encode_lm_chunk(tok, roles, ["the answer", prompt + completion], np.array([0, len(prompt)]), 16)
    first, second = chunk.ids[:chunk.lengths[0]].tolist(), chunk.ids[chunk.lengths[0]:].tolist()
    assert first == [0, *ids_of(tok, "the answer"), 1] and chunk.n_prompt[0] == 0
    assert second == [0, *ids_of(tok, prompt), *ids_of(tok, "four"), 1]
    assert chunk.n_prompt[1] == 1 + len(ids_of(tok, prompt))
    assert second[chunk.n_prompt[1]] == tok.token_to_id("four")
    assert chunk.truncated == 0 and not chunk.dropped


def test_truncation_keeps_eos_and_a_completion_cut_away_is_dropped() -> None:
    tok = word_tokenizer()
    roles = Roles(eos_id=1, pad_id=1)
    long_text = " ".join(["a"] * 20)
    prompt = " ".join(["b"] * 7)  # 7 tokens: with max_len 8 not one completion token fits after it (+ EOS)
    fits = " ".join(["c"] * 4)
    texts = [long_text, prompt + " d e", fits + " d e e e e e"]
    chunk = encode_lm_chunk(tok, roles, texts, np.array([0, len(prompt), len(fits)]), 8)
    assert chunk.dropped == [(1, "no_completion_fits")]
    assert chunk.truncated == 2  # the text and the third row (its completion cut, not away)
    seqs = np.split(chunk.ids, np.cumsum(chunk.lengths)[:-1])
    assert [len(s) for s in seqs] == [8, 8] and all(s[-1] == 1 for s in seqs)  # EOS kept
    assert chunk.n_prompt.tolist() == [0, 4]
    too_long = encode_lm_chunk(tok, roles, [" ".join(["b"] * 9) + " d"], np.array([17]), 8)
    assert too_long.dropped == [(0, "prompt_too_long")]


# -- batches -----------------------------------------------------------------------------------------------------

def test_padded_batch_targets_padding_and_eos_as_pad() -> None:
    eos = pad = 1  # a Llama-like tokenizer: no pad token, EOS's id pads
    a = np.array([0, 10, 11, 20, eos], dtype=np.int32)  # BOS, prompt 10 11, completion 20, EOS: n_prompt 3
    b = np.array([5, 6, eos], dtype=np.int32)  # a text
    batch = CausalPadCollate(pad, [4, 8], "bound")([(a, 3), (b, 0)])
    assert batch["input_ids"].shape == (2, 8) and batch["input_ids"].dtype == torch.long
    assert batch["labels"][0].tolist() == [-100, -100, 20, eos] + [-100] * 4
    assert batch["labels"][1].tolist() == [6, eos] + [-100] * 6
    assert batch["attention_mask"].sum(1).tolist() == [5, 3]
    assert (batch["input_ids"][1, 3:] == eos).all()  # padded with EOS's id ...
    assert (batch["labels"][~batch["attention_mask"]] == -100).all()  # ... never trained: masked by position
    assert (batch["labels"] == eos).sum() == 2  # the real EOS targets stay trained
    assert (batch["samples"], batch["real_tokens"], batch["target_tokens"], batch["truncated"]) == (2, 8, 4, 0)


def test_padded_batch_filler_rows_and_truncation() -> None:
    collate = CausalPadCollate(0, [4], "bound", rows=[[4]])
    long = np.array([7, 8, 9, 10, 11, 1])
    batch = collate([(long, 0), (np.array([5, 1]), 0)])
    assert batch["input_ids"].shape == (4, 4) and batch["samples"] == 2
    assert batch["input_ids"][0].tolist() == [7, 8, 9, 1] and batch["truncated"] == 1  # cut, EOS kept
    assert (batch["labels"][2:] == -100).all()  # filler rows train nothing
    cut_away = collate([(np.array([2, 3, 4, 5, 6, 1]), 4)])  # prompt of 4: no completion token left in 4 positions
    assert (cut_away["labels"] == -100).all() and cut_away["target_tokens"] == 0


def test_packed_rows_restart_positions_and_never_cross_a_sample() -> None:
    samples = [(np.array([0, 10, 20, 21, 1]), 2), (np.array([0, 30, 1]), 0), (np.array([0, 40, 41, 42, 1]), 3)]
    collate = CausalPackCollate(1, 10, 2, max_seqs=6)
    batch = collate([[samples[0], samples[1]], [samples[2]]])
    ids, labels, pos, seq = (batch[k] for k in ("input_ids", "labels", "position_ids", "seq_index"))
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 0] and pos[1, :5].tolist() == [0, 1, 2, 3, 4]
    assert seq[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, -1, -1] and seq[1, :6].tolist() == [2] * 5 + [-1]
    assert labels[0].tolist() == [-100, 20, 21, 1, -100, 30, 1, -100, -100, -100]
    assert labels[1, :5].tolist() == [-100, -100, 42, 1, -100]
    trained = (labels != -100).nonzero().tolist()
    for r, t in trained:  # every target is the next token of the same sample
        assert seq[r, t] == seq[r, t + 1] >= 0 and labels[r, t] == ids[r, t + 1]
    assert (batch["samples"], batch["num_seqs"], batch["target_tokens"]) == (3, 6, 7)
    assert batch["real_tokens"] == 13 and (labels[~batch["attention_mask"]] == -100).all()


def test_classification_collates_are_unchanged() -> None:
    assert type(pad_collate_for("classification", 0, [4, 8])) is PadCollate
    assert type(pack_collate_for("classification", 0, 8, 2)) is PackCollate
    assert type(pad_collate_for("causal-lm", 0, [4, 8])) is CausalPadCollate
    assert type(pack_collate_for("causal-lm", 0, 8, 2)) is CausalPackCollate
    items = [(np.array([2, 5, 6, 3], np.int32), 1), (np.array([2, 7, 3], np.int32), 0)]
    want, got = PadCollate(0, [4, 8], "bound")(items), pad_collate_for("classification", 0, [4, 8])(items)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) if torch.is_tensor(want[k])
                                             else want[k] == got[k] for k in want)


def test_classification_cache_keys_are_unchanged() -> None:
    from train.data.cache import cache_key

    sha = "ab" * 32
    assert cache_key(DataConfig(), sha, None) == "e334c85a02df5670e98f"  # the keys before causal-lm existed
    assert cache_key(DataConfig(source="x.jsonl", max_len=64, vocab_size=300), sha, "fp") == "70f1049d21a321c5747e"


# -- the tokenizer -----------------------------------------------------------------------------------------------

TEXTS = [f"the {w} number {i} is {i * 7 % 13} and {w}s like it" for i in range(300) for w in ("cat", "dog", "owl")]


def test_bpe_is_deterministic_across_processes_and_cached(tmp_path: Path) -> None:
    a, b = train_bpe(TEXTS, 400), train_bpe(TEXTS, 400)
    assert a.to_str() == b.to_str() and a.token_to_id(EOT) == 0
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from train.data.causal_tokenizer import train_bpe; "
            f"print(train_bpe({TEXTS!r}, 400).to_str(), end='')")
    other = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent.parent)],
                           capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert other == a.to_str()
    tok, info, roles = load_or_train_lm(TEXTS, 400, str(tmp_path))
    assert info["source"] == "trained" and Path(info["path"]).read_text() == a.to_str(pretty=True)
    assert (roles.eos_id, roles.pad_id, roles.bos_id, roles.add_bos) == (0, 0, None, False)
    assert info["vocab_size"] == tok.get_vocab_size() <= 400 and info["roles"]["pad_is_eos"]
    again, info2, _ = load_or_train_lm(TEXTS, 400, str(tmp_path))
    assert info2["source"] == "cache-hit" and info2["fingerprint"] == info["fingerprint"]
    assert load_or_train_lm(TEXTS[:-1], 400, str(tmp_path))[1]["path"] != info["path"]
    text = "the owl number 12 is 5"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless


def write_model_tokenizer(d: Path, config: dict | None = None, bos_template: bool = False, **tok_config) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    word_tokenizer(("<s>", "</s>", "<pad>"), bos_template).save(str(d / "tokenizer.json"))
    if tok_config:
        (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d / "tokenizer.json"


def roles_of(path: Path) -> Roles:
    tok = Tokenizer.from_file(str(path))
    return read_roles(tok, path.parent, str(path))


def test_a_model_directory_tokenizers_roles(tmp_path: Path) -> None:
    llama = write_model_tokenizer(tmp_path / "llama", bos_template=True, bos_token="<s>",
                                  eos_token={"__type": "AddedToken", "content": "</s>", "lstrip": False})
    assert roles_of(llama) == Roles(eos_id=1, pad_id=1, bos_id=0, add_bos=True, read_from="tokenizer_config.json")
    no_bos = write_model_tokenizer(tmp_path / "off", bos_template=True, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", add_bos_token=False)
    r = roles_of(no_bos)
    assert (r.bos_id, r.add_bos, r.pad_id, r.pad_is_eos) == (0, False, 2, False)
    gpt2 = write_model_tokenizer(tmp_path / "gpt2", bos_token="<s>", eos_token="</s>")  # no template: no BOS added
    assert roles_of(gpt2).add_bos is False
    ids_only = write_model_tokenizer(tmp_path / "ids", config={"bos_token_id": 0, "eos_token_id": [1, 2]})
    assert roles_of(ids_only) == Roles(eos_id=1, pad_id=1, bos_id=0, add_bos=False, read_from="config.json")


def test_prepared_pairs_from_a_model_tokenizer(tmp_path: Path) -> None:
    path = write_model_tokenizer(tmp_path / "m", bos_template=True, bos_token="<s>", eos_token="</s>")
    rows = [{"prompt": f"what is {w}", "completion": " the answer"} for w in WORDS[:8] for _ in range(8)]
    rows += [{"text": "a b c d e"}] * 30 + [{"prompt": " ".join(["q"] * 14), "completion": "a b c"}]  # dropped
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    from train.data import make_loader, prepare_data

    said: list[str] = []
    bundle = prepare_data(cfg_for(tmp_path, f"data.source={src}", f"data.tokenizer_path={path}"), notice=said.append)
    assert (bundle.task, bundle.bos_id, bundle.eos_id, bundle.pad_id, bundle.vocab_size) == ("causal-lm", 0, 1, 1,
                                                                                             3 + 1 + len(WORDS))
    dropped = [line for line in said if "dropped" in line]
    assert len(dropped) == 1 and dropped[0].startswith("warning: 1 row dropped, nothing to learn from them: 1 no "
                                                        "completion token fits after the prompt in data.max_len=16 (")
    assert f"{src}:{len(rows)})" in dropped[0]  # the row named, numbered as in the file
    assert bundle.data_facts["dropped_rows"] == {"no_completion_fits": 1}
    tok = Tokenizer.from_file(str(path))
    n = {name: len(s) for name, s in bundle.splits.items()}
    assert sum(n.values()) == len(rows) - 1 and all(len(bundle.corpus.split(k)) == v for k, v in n.items())
    split = bundle.splits["train"]
    for ids, n_prompt, text in zip(split.ids, split.labels, bundle.corpus.train.texts):
        assert ids[0] == 0 and ids[-1] == 1  # BOS ... EOS
        if n_prompt:
            assert ids[n_prompt:-1].tolist() == ids_of(tok, "the answer") and text.endswith(" the answer")
        else:
            assert ids[1:-1].tolist() == ids_of(tok, "a b c d e")
    cfg = cfg_for(tmp_path, f"data.source={src}", f"data.tokenizer_path={path}")
    batch = next(iter(make_loader(bundle, "train", cfg, True, torch.device("cpu"))))
    assert batch["labels"].shape == batch["input_ids"].shape and batch["target_tokens"] > 0


def test_wordnet_glosses_are_text_rows_split_like_classification(wndb: Path) -> None:
    from train.data.sources import scan_source

    cfg = DataConfig(wordnet_dir=str(wndb))
    rows = list(lm_rows_for(cfg)[1])
    assert rows and all(prompt == "" and cause is None for _, prompt, _, _, cause in rows)
    texts: list[str] = []
    classified: list[str] = []
    lm = scan_lm_source(cfg, texts.append)
    cls = scan_source(cfg, classified.append)
    assert texts == [gloss for _, _, gloss, _, _ in rows] and len(texts) == len(classified)
    assert all(c.endswith(": " + t) for c, t in zip(classified, texts))  # "lemmas: gloss" → the gloss alone
    assert all((lm.splits[s] == cls.splits[s]).all() for s in lm.splits) and lm.label_names == []
    assert (lm.labels == 0).all()


def test_wordnet_prepares_for_causal_lm(tmp_path: Path, wndb: Path) -> None:
    from train.data import prepare_data

    cfg = cfg_for(tmp_path, f"data.wordnet_dir={wndb}", "data.max_len=12")
    bundle = prepare_data(cfg, notice=lambda _m: None)
    split = bundle.splits["train"]
    assert bundle.tokenizer_info["roles"]["eos_id"] == 0 and bundle.bos_id is None
    assert all(ids[-1] == 0 and len(ids) <= 12 for ids in split.ids) and split.truncated > 0
    again = prepare_data(cfg, notice=lambda _m: None)
    assert again.cache["cache"] == "hit" and again.data_fingerprint == bundle.data_fingerprint
    classification = load_config(None, [f"data.wordnet_dir={wndb}", f"data.cache_dir={tmp_path / 'cache'}",
                                        "data.max_len=12", "data.vocab_size=300", "train.progress=false"])
    assert prepare_data(classification, notice=lambda _m: None).cache["cache"] == "miss"  # another entry


# -- bad input: one line each ------------------------------------------------------------------------------------

def bad(tmp_path: Path, rows: list, *overrides: str) -> str:
    from train.data import prepare_data

    src = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError) as info:
        prepare_data(cfg_for(tmp_path, f"data.source={src}", *overrides), notice=lambda _m: None)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_row_with_neither_text_nor_completion(tmp_path: Path) -> None:
    msg = bad(tmp_path, [{"text": "a b"}, {"body": "x"}])
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}:2: neither a text field 'text' nor a completion field")
    assert "(fields: body)" in msg and "data.prompt_field and data.completion_field" in msg


def test_an_empty_completion_and_a_prompt_without_one(tmp_path: Path) -> None:
    assert "row a model cannot learn from: " + f"{tmp_path / 'd.jsonl'}:2: whitespace-only completion; " in \
        bad(tmp_path, [{"text": "a"}, {"prompt": "q", "completion": " "}], "data.on_bad_row=error")
    assert "d.jsonl:1: a prompt without a completion" in bad(tmp_path, [{"prompt": "q"}])
    assert "d.jsonl:1: completion ('completion') must be a string, got int" in \
        bad(tmp_path, [{"prompt": "q", "completion": 3}])
    assert "d.jsonl:1: both a text" in bad(tmp_path, [{"text": "a", "prompt": "q", "completion": "c"}])


def test_a_prompt_longer_than_max_len_writes_nothing(tmp_path: Path) -> None:
    rows = [{"text": f"row {i} of text"} for i in range(40)] + [{"prompt": "word " * 40, "completion": "end"}]
    msg = bad(tmp_path, rows, "data.on_bad_row=error")
    assert msg.startswith(f"1 row a model cannot learn from: {tmp_path / 'd.jsonl'}:41: prompt longer than "
                          "data.max_len=16; ")
    assert not [p for p in (tmp_path / "cache" / "data").iterdir()]  # no entry, no temporary directory left


def test_a_tokenizer_without_eos(tmp_path: Path) -> None:
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    word_tokenizer(("<s>",)).save(str(path))
    msg = bad(tmp_path, [{"text": "a b"}] * 20, f"data.tokenizer_path={path}")
    assert msg.startswith(f"{path}: the tokenizer has no EOS token") and "set eos_token" in msg
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert "eos_token '<eos>' (tokenizer_config.json / special_tokens_map.json) is not in the vocabulary" in \
        bad(tmp_path, [{"text": "a b"}] * 20, f"data.tokenizer_path={path}")


def test_a_vocabulary_below_the_bpe_alphabet_keeps_the_alphabet(tmp_path: Path) -> None:
    tok, info, _ = load_or_train_lm(TEXTS, 100, str(tmp_path))
    assert info["vocab_size"] == tok.get_vocab_size() == MIN_BPE_VOCAB  # the 256 bytes and <|endoftext|>: no merge


def test_csv_without_either_form_of_columns(tmp_path: Path) -> None:
    with open(tmp_path / "d.csv", "w", newline="") as f:
        csv.writer(f).writerows([["prompt", "answer"], ["q", "a"]])
    cfg = DataConfig(source=str(tmp_path / "d.csv"))
    with pytest.raises(UserError, match=r"d\.csv:1: no text column 'text' and no 'prompt' \+ 'completion' columns "
                                        r"\(columns: prompt, answer\)"):
        list(lm_rows_for(cfg)[1])
    with open(tmp_path / "e.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text", "prompt", "completion"], ["", "q", "a"], ["t", "", ""], ["", "", ""]])
    rows = lm_rows_for(DataConfig(source=str(tmp_path / "e.csv")))[1]
    assert [next(rows)[1:3], next(rows)[1:3]] == [("q", "a"), ("", "t")]  # blank cells: not given
    assert next(rows)[1:] == ("", "", f"{tmp_path / 'e.csv'}:4", "empty_text")  # data.on_bad_row decides


def test_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "completion": ""}])
    proc = run_cli("buckets", "model.task=causal-lm", f"data.source={src}", f"data.cache_dir={tmp_path / 'c'}",
                   f"train.output_dir={tmp_path / 'runs'}", "data.on_bad_row=error")
    assert_clean_error(proc, f"{src}:1: whitespace-only completion")
    assert proc.stderr.count("\n") == 1

"""Prepared data built in bounded memory (train/data/prepare.py, issue 31 #1 and #6): the streamed cache entry is byte
for byte what the in-memory build wrote (a frozen copy of that build is kept here as the reference), bad input gets
the same message, the source is read, tokenized and written in chunks, ``[UNK]``-only words are counted and
reported, and temporary directories of dead writers are cleaned."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import write_jsonl
from train.config import RunConfig
from train.data import cache, prepare, prepare_splits
from train.data.readers import rows_for
from train.data.sources import SPARSE_SLACK, split_of, stable_fraction
from train.data.tokenizer import load_or_train, pad_id
from train.data.word_cache import WordCacheEncoder
from train.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
ARRAYS = [f"{s}.{k}.npy" for s in ("train", "validation", "test")
          for k in ("ids", "offsets", "labels", "texts", "text_offsets")]


# --- the reference: the in-memory build as it was before streaming (frozen; do not "fix" it to match) -------------

def _reference_labels(raw: list, locs: list[str], cfg, names):
    is_int = [isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in raw]
    if all(is_int):
        ids = np.asarray(raw, dtype=np.int64)
        distinct = np.unique(ids)
        top = int(ids.max())
        if cfg.num_classes is None and not names and top + 1 > max(2 * distinct.size, distinct.size + SPARSE_SLACK):
            shown = ", ".join(map(str, distinct[:5].tolist())) + (", …" if distinct.size > 5 else "")
            raise UserError(f"data: {distinct.size} distinct integer labels ({shown}) but the largest is {top}, "
                            f"so num_classes would be {top + 1}; remap the labels to 0..{distinct.size - 1} "
                            "(or use them as strings), or set data.num_classes")
        n = cfg.num_classes or (len(names) if names else int(ids.max()) + 1)
        bad = np.flatnonzero((ids < 0) | (ids >= n))
        if bad.size:
            i = int(bad[0])
            raise UserError(f"{locs[i]}: label {raw[i]} is out of range [0, {n}); "
                            "fix the label or set data.num_classes")
        return ids, names[:n] if names else [str(k) for k in range(n)]
    for i, (x, ok) in enumerate(zip(raw, is_int)):
        if not ok and not isinstance(x, str):
            raise UserError(f"{locs[i]}: label {x!r} must be a string or an integer")
        if not ok and not x.strip():
            raise UserError(f"{locs[i]}: empty label")
    if any(is_int):
        i = is_int.index(True) if not is_int[0] else is_int.index(False)
        raise UserError(f"{locs[i]}: labels mix strings and integers; use one kind for every row")
    label_names = sorted(set(raw))
    index = {name: k for k, name in enumerate(label_names)}
    if cfg.num_classes is not None and len(label_names) > cfg.num_classes:
        raise UserError(f"data has {len(label_names)} distinct labels but data.num_classes={cfg.num_classes}")
    return np.asarray([index[x] for x in raw], dtype=np.int64), label_names


def _reference_corpus(cfg) -> tuple[str, list[str], dict[str, tuple[list[str], np.ndarray]]]:
    from train.data import wordnet

    name, rows = rows_for(cfg)
    keys, texts, raw, locs = [], [], [], []
    for key, text, label, loc in rows:
        if not isinstance(text, str):
            raise UserError(f"{loc}: text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise UserError(f"{loc}: empty text; remove the row or fill in {cfg.text_field!r}")
        if label is None:
            raise UserError(f"{loc}: missing label")
        keys.append(key)
        texts.append(text)
        raw.append(label)
        locs.append(loc)
    if not texts:
        raise UserError(f"data.source={cfg.source!r}: no examples found")
    labels, label_names = _reference_labels(raw, locs, cfg, list(wordnet.LEXNAMES) if name == "wordnet" else None)
    order = sorted(range(len(keys)), key=lambda i: stable_fraction(keys[i]))
    buckets: dict[str, list[int]] = {"train": [], "validation": [], "test": []}
    for i in order:
        buckets[split_of(keys[i], cfg.val_fraction, cfg.test_fraction)].append(i)
    if cfg.max_samples is not None:
        tenth = max(1, cfg.max_samples // 10)
        caps = {"train": cfg.max_samples, "validation": tenth, "test": tenth}
        buckets = {s: idx[: caps[s]] for s, idx in buckets.items()}
    if not buckets["train"]:
        raise UserError(f"data.source={cfg.source!r}: the training split is empty ({len(texts)} examples in all)")
    return name, label_names, {s: ([texts[i] for i in idx], labels[np.asarray(idx, dtype=np.int64)] if idx
                                   else np.zeros(0, np.int64)) for s, idx in buckets.items()}


def _offsets(lengths) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


def reference_entry(cfg: RunConfig, out: Path, tok_cache: Path) -> dict:
    """The entry the in-memory build wrote (every text, every Encoding at once), as files under ``out``."""
    name, label_names, splits = _reference_corpus(cfg.data)
    tok, info = load_or_train(splits["train"][0], cfg.data.vocab_size, str(tok_cache), cfg.data.tokenizer_path)
    tok.no_truncation()
    tok.no_padding()
    out.mkdir(parents=True)
    meta: dict[str, Any] = {"name": name, "label_names": label_names, "vocab_size": tok.get_vocab_size(),
                            "pad_id": pad_id(tok), "splits": {}}
    h = hashlib.sha256()
    for t in splits["train"][0]:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    meta["data_fingerprint"] = h.hexdigest()[:16]
    for s, (texts, labels) in splits.items():
        ids, truncated = [], 0
        for enc in tok.encode_batch(texts):
            seq = enc.ids
            if len(seq) > cfg.data.max_len:
                truncated += 1
                seq = seq[: cfg.data.max_len - 1] + seq[-1:]
            ids.append(np.asarray(seq, dtype=np.int32))
        encoded = [t.encode("utf-8") for t in texts]
        np.save(out / f"{s}.ids.npy", np.concatenate(ids) if ids else np.zeros(0, np.int32))
        np.save(out / f"{s}.offsets.npy", _offsets([len(x) for x in ids]))
        np.save(out / f"{s}.labels.npy", np.asarray(labels, dtype=np.int64))
        np.save(out / f"{s}.texts.npy", np.frombuffer(b"".join(encoded), dtype=np.uint8))
        np.save(out / f"{s}.text_offsets.npy", _offsets([len(b) for b in encoded]))
        meta["splits"][s] = {"rows": len(texts), "truncated": truncated}
    tok.save(str(out / "tokenizer.json"))
    return meta


# --- sources ------------------------------------------------------------------------------------------------------

WORDS = ["alpha", "Beta", "ΟΔΟΣ", "İstanbul", "straße", "naïve", "e\u0301", "東京", "[SEP]", "\t", "\u00a0", "😀",
         "a,b",
         "don't", "", "ﬁ", "delta", "epsilon", "x" * 5000, "y" * 300]


def tricky_rows(n: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = "".join(rng.choice(WORDS[:-2] if rng.random() < 0.97 else WORDS) + rng.choice([" ", " ", "  ", ""])
                       for _ in range(rng.randint(1, 30)))
        text = text if text.strip() and rng.random() > 0.04 else "the same text"
        rows.append({"text": text, "label": rng.choice("pnx")})
    return rows


def _sources(tmp: Path, wndb: Path) -> dict[str, list[str]]:
    rows = tricky_rows(700)
    (tmp / "s.jsonl").write_text("".join(json.dumps(r, ensure_ascii=i % 2 == 0) + "\n" for i, r in enumerate(rows)),
                                 encoding="utf-8")
    write_jsonl(tmp / "i.jsonl", [{"t": r["text"], "y": i % 4} for i, r in enumerate(rows)])
    with open(tmp / "c.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["body", "queue"])
        w.writerows([r["text"], str(i % 3)] for i, r in enumerate(rows[:300]))
    return {
        "jsonl": [f"data.source={tmp / 's.jsonl'}", "data.max_len=24", "data.vocab_size=300"],
        "ints-capped": [f"data.source={tmp / 'i.jsonl'}", "data.text_field=t", "data.label_field=y",
                        "data.max_samples=200"],
        "no-test-split": [f"data.source={tmp / 's.jsonl'}", "data.val_fraction=0.2", "data.test_fraction=0",
                          "data.max_len=8"],
        "csv": [f"data.source={tmp / 'c.csv'}", "data.text_field=body", "data.label_field=queue"],
        "wordnet": [f"data.wordnet_dir={wndb}"],
    }


def _same_entry(streamed: Path, reference: Path, meta: dict) -> None:
    for f in ARRAYS + ["tokenizer.json"]:
        assert (streamed / f).read_bytes() == (reference / f).read_bytes(), f
    got = json.loads((streamed / "meta.json").read_text())
    assert {k: got[k] for k in ("name", "label_names", "vocab_size", "pad_id", "data_fingerprint")} == \
        {k: meta[k] for k in ("name", "label_names", "vocab_size", "pad_id", "data_fingerprint")}
    assert {s: {k: v[k] for k in ("rows", "truncated")} for s, v in got["splits"].items()} == meta["splits"]


def test_the_streamed_entry_is_byte_identical_to_the_in_memory_build(tiny_cfg, tmp_path: Path, wndb: Path) -> None:
    for name, overrides in _sources(tmp_path, wndb).items():
        cfg = tiny_cfg(*overrides, f"data.cache_dir={tmp_path / 'c' / name}")
        p = prepare_splits(cfg)
        assert p.cache["cache"] == "miss" and p.tokenizer_info["source"] == "trained"
        meta = reference_entry(cfg, tmp_path / "ref" / name, tmp_path / "ref-tok" / name)
        _same_entry(Path(p.cache["cache_dir"]), tmp_path / "ref" / name, meta)
        hit = prepare_splits(cfg)  # the warm path reads it as before
        assert hit.cache["cache"] == "hit"
        assert [len(s) for s in hit.splits.values()] == [m["rows"] for m in meta["splits"].values()]
        cfg.data.cache_prepared = False  # no cache: built in a scratch directory, mapped, removed
        off = prepare_splits(cfg)
        assert off.cache["cache"] == "off"
        assert all(np.array_equal(off.splits[s].lengths, hit.splits[s].lengths) for s in hit.splits)
        assert list(off.corpus.train.texts) == list(hit.corpus.train.texts)


def test_small_chunks_and_a_small_word_cache_give_the_same_bytes(tiny_cfg, tmp_path: Path, wndb: Path,
                                                                  monkeypatch) -> None:
    overrides = _sources(tmp_path, wndb)["jsonl"]
    chunk_sizes: list[int] = []
    real_read = prepare.read_texts

    def read(path, offsets, chunk=None):
        for texts in real_read(path, offsets, chunk):
            chunk_sizes.append(len(texts))
            yield texts

    monkeypatch.setattr(prepare, "CHUNK_ROWS", 37)
    monkeypatch.setattr(prepare, "FLUSH_BYTES", 1000)
    monkeypatch.setattr(prepare, "read_texts", read)
    monkeypatch.setattr(WordCacheEncoder, "MAX_WORDS", 40)  # the word cache starts again many times
    cfg = tiny_cfg(*overrides, f"data.cache_dir={tmp_path / 'c'}")
    p = prepare_splits(cfg)
    # the tokenizer was trained on, and every split encoded from, chunks of at most 37 texts
    assert max(chunk_sizes) == 37 and sum(chunk_sizes) == len(p.splits["train"]) * 2 + len(p.splits["validation"]) + \
        len(p.splits["test"])
    meta = reference_entry(cfg, tmp_path / "ref", tmp_path / "ref-tok")
    _same_entry(Path(p.cache["cache_dir"]), tmp_path / "ref", meta)


BAD_JSONL = {
    "a label error, then malformed JSON further on": ['{"text": "a", "label": 1.5}', '{"text": "b", "label": "x"}',
                                                      "{oops"],
    "a float label": ['{"text": "a", "label": "x"}', '{"text": "b", "label": 2.5}', '{"text": "c", "label": "y"}'],
    "a bool label": ['{"text": "a", "label": true}', '{"text": "b", "label": "x"}'],
    "an empty label after a mix": ['{"text": "a", "label": 1}', '{"text": "b", "label": "x"}',
                                   '{"text": "c", "label": " "}'],
    "ints then strings": ['{"text": "a", "label": 0}', '{"text": "b", "label": 1}', '{"text": "c", "label": "x"}'],
    "strings then ints": ['{"text": "a", "label": "x"}', '{"text": "b", "label": "y"}', '{"text": "c", "label": 3}'],
    "out of range": ['{"text": "a", "label": 0}', '{"text": "b", "label": -1}', '{"text": "c", "label": 1}'],
    "sparse": ['{"text": "a", "label": 3}', '{"text": "b", "label": 200000000}'],
    "missing label": ['{"text": "a", "label": "x"}', '{"text": "b", "label": null}'],
    "empty text": ['{"text": "a", "label": "x"}', '{"text": "  ", "label": "y"}'],
    "no rows": ["", "  "],
    "an empty training split": ['{"text": "a", "label": "x"}', '{"text": "c", "label": "y"}'],  # hashes 0.25, 0.22
}


@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_bad_input_gets_the_message_the_in_memory_build_gave(case: str, tiny_cfg, tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(BAD_JSONL[case]) + "\n", encoding="utf-8")
    extra = ["data.val_fraction=0.3", "data.test_fraction=0.3"] if case == "an empty training split" else []
    cfg = tiny_cfg(f"data.source={src}", *extra)
    with pytest.raises(UserError) as want:
        _reference_corpus(cfg.data)
    with pytest.raises(UserError) as got:
        prepare_splits(cfg)
    assert str(got.value) == str(want.value)
    cfg.data.num_classes = 2
    if case == "out of range":  # with num_classes too
        with pytest.raises(UserError, match=r"bad\.jsonl:2: label -1 is out of range \[0, 2\)"):
            prepare_splits(cfg)
    leftovers = [p for p in (tmp_path / "cache" / "data").glob(".*")] if (tmp_path / "cache" / "data").is_dir() else []
    assert not leftovers  # a refused build leaves no temporary directory behind


def test_a_label_beyond_int64_is_an_error_not_a_traceback(tiny_cfg, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 2**70}])
    with pytest.raises(UserError, match=rf"d\.jsonl:2: label {2**70} is out of range \[0, 2\)"):
        prepare_splits(tiny_cfg(f"data.source={src}", "data.num_classes=2"))


def test_unk_only_words_are_counted_and_reported(tiny_cfg, tmp_path: Path) -> None:
    from train.run.training import run_training

    long_word = "q" * 5000  # once silently one [UNK]
    rows = [{"text": f"word {i % 7} and more words here" + (f" {long_word}" if i % 10 == 0 else ""),
             "label": "ab"[i % 2]} for i in range(200)]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = tiny_cfg(f"data.source={src}", "train.max_steps=2", "train.eval_every=2", "train.run_id=unk")
    p = prepare_splits(cfg)
    assert sum(s.unk_only_words for s in p.splits.values()) == 20
    entry = Path(p.cache["cache_dir"])
    meta = json.loads((entry / "meta.json").read_text())
    assert sum(s["unk_only_words"] for s in meta["splits"].values()) == 20
    report = run_training(cfg, time.perf_counter())
    assert report["data"]["unk_only_words"] == 20 and report["data"]["cache"] == "hit"
    for s in meta["splits"].values():  # an entry written before the count existed: unknown, not 0
        del s["unk_only_words"]
    (entry / "meta.json").write_text(json.dumps(meta))
    assert [s.unk_only_words for s in cache.load(entry).splits.values()] == [None, None, None]


def test_preparation_shows_rows_per_second_on_a_terminal(tiny_cfg, tmp_path: Path, capsys, monkeypatch) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": f"some words {i}", "label": "ab"[i % 2]} for i in range(300)])
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    prepare_splits(tiny_cfg(f"data.source={src}", "train.progress=true"))
    err = capsys.readouterr().err
    for phase in ("reading data", "training the tokenizer", "tokenizing"):
        assert phase in err, err
    assert "row/s" in err and "300" in err


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temporary_directories_of_dead_writers_are_removed(tiny_cfg, tmp_path: Path) -> None:
    data = tmp_path / "cache" / "data"
    data.mkdir(parents=True)
    me = cache.writer_tag()
    host_part = me.split("-", 1)[1]  # "<pid namespace>@<host>"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dirs = {"dead": data / f".{'a' * 20}.{_dead_pid()}-{host_part}.abcd1234",
                "live": data / f".{'b' * 20}.{live.pid}-{host_part}.abcd1234",
                "legacy old": data / f".{'c' * 20}.k2j4h5g6", "legacy new": data / f".{'d' * 20}.k2j4h5g7",
                "other host old": data / f".{'e' * 20}.123-1@elsewhere.example.abcd1234",
                "other host new": data / f".{'f' * 20}.123-1@elsewhere.example.abcd1235"}
        for d in dirs.values():
            d.mkdir()
            (d / "train.ids.npy").write_bytes(b"x" * 1000)
        old = time.time() - 2 * cache.STALE_AFTER_S
        for name in ("legacy old", "other host old"):
            os.utime(dirs[name] / "train.ids.npy", (old, old))
            os.utime(dirs[name], (old, old))
        (data / "unrelated").mkdir()
        assert prepare_splits(tiny_cfg()).cache["cache"] == "miss"
        assert {name for name, d in dirs.items() if d.exists()} == {"live", "legacy new", "other host new"}
        assert (data / "unrelated").is_dir()
    finally:
        live.kill()
        live.wait()


def test_a_writer_killed_mid_preparation_leaves_nothing_after_the_next_run(tiny_cfg, tmp_path: Path) -> None:
    rows = [{"text": f"words {i} more {i % 13}", "label": "ab"[i % 2]} for i in range(400)]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = tiny_cfg(f"data.source={src}")
    data = Path(cfg.data.cache_dir) / "data"
    # the writer hangs inside its first numpy.save: its temporary directory exists, then it is killed with SIGKILL
    script = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import numpy as np
from train.config import load_config
from train.data import prepare_splits
def hang(*a, **k):
    print("writing", flush=True)
    time.sleep(120)
np.save = hang
cfg = load_config(None, {[f'data.source={src}', f'data.cache_dir={cfg.data.cache_dir}', 'data.vocab_size=200',
                          'data.max_len=32', 'train.progress=false']!r})
prepare_splits(cfg)
"""
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        left = [p for p in data.iterdir() if p.name.startswith(".")]
        assert len(left) == 1 and left[0].is_dir()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    p = prepare_splits(cfg)
    assert p.cache["cache"] == "miss" and [q.name for q in data.iterdir()] == [Path(p.cache["cache_dir"]).name]


@pytest.mark.slow
def test_peak_memory_stays_flat_on_a_large_file(tmp_path: Path) -> None:
    """300 k rows (~48 MB): the in-memory build peaked at ~1.5 GiB for 200 k rows; streamed, the process stays near
    what importing torch costs (measured: 0.30 GiB at 0.2 M rows, 0.57 GiB at 2 M rows)."""
    src = tmp_path / "big.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_big_jsonl.py"), str(src), "--rows", "300000"],
                   check=True)
    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
from train.config import load_config
from train.data import prepare_splits
p = prepare_splits(load_config({str(ROOT / 'configs' / 'cpu-tiny.yaml')!r},
                               ["data.source={src}", "data.cache_dir={tmp_path / 'c'}", "train.progress=false"]))
print(len(p.splits["train"]), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    rows, peak_mib = int(out[0]), int(out[1])
    assert rows > 250_000 and peak_mib < 700, peak_mib

"""Prepared data cached once: hit/miss, the same arrays as a fresh build, invalidation by one changed byte,
report.json facts, and --resume refusing another tokenizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_jsonl
from train.data import prepare_splits
from train.data.cache import Ragged, Texts, source_fingerprint
from train.data.tokenizer import train_wordpiece
from train.errors import UserError
from train.resume import list_checkpoints
from train.run.training import run_training


def assert_same(a, b) -> None:
    assert a.corpus.label_names == b.corpus.label_names and a.data_fingerprint == b.data_fingerprint
    assert a.tokenizer_info["fingerprint"] == b.tokenizer_info["fingerprint"] and a.pad_id == b.pad_id
    for name in ("train", "validation", "test"):
        sa, sb = a.splits[name], b.splits[name]
        assert len(sa) == len(sb) and sa.truncated == sb.truncated
        assert all(np.array_equal(x, y) for x, y in zip(sa.ids, sb.ids))
        assert np.array_equal(sa.labels, sb.labels) and np.array_equal(sa.lengths, sb.lengths)
        assert list(a.corpus.split(name).texts) == list(b.corpus.split(name).texts)


def test_miss_then_hit_gives_the_same_data(tiny_cfg) -> None:
    cfg = tiny_cfg()
    first = prepare_splits(cfg)
    second = prepare_splits(cfg)
    assert first.cache["cache"] == "miss" and second.cache["cache"] == "hit"
    assert first.cache["cache_dir"] == second.cache["cache_dir"] and "cache_unavailable_reason" not in first.cache
    assert isinstance(second.splits["train"].ids, Ragged)  # memory-mapped rows, not a copy
    assert_same(first, second)
    cfg.data.cache_prepared = False
    off = prepare_splits(cfg)
    assert off.cache == {"cache": "off", "cache_unavailable_reason": "data.cache_prepared=false"}
    assert_same(first, off)


def test_one_changed_byte_in_the_source_is_a_miss(tiny_cfg, wndb: Path) -> None:
    cfg = tiny_cfg()
    before = prepare_splits(cfg)
    noun = wndb / "data.noun"
    text = noun.read_text(encoding="utf-8")
    i = text.rindex("mammal")
    noun.write_text(text[:i] + "M" + text[i + 1:], encoding="utf-8")  # same length: offsets stay valid
    after = prepare_splits(cfg)
    assert after.cache["cache"] == "miss" and after.cache["cache_dir"] != before.cache["cache_dir"]
    assert prepare_splits(cfg).cache["cache"] == "hit"
    # settings the data depends on are part of the key too
    cfg.data.max_len = 16
    assert prepare_splits(cfg).cache["cache"] == "miss"


def test_file_source_is_cached_by_content(tmp_path: Path, tiny_cfg) -> None:
    rows = [{"text": f"{w} number {i}", "label": w} for i in range(40) for w in ("cat", "dog")]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = tiny_cfg(f"data.source={src}")
    assert prepare_splits(cfg).cache["cache"] == "miss" and prepare_splits(cfg).cache["cache"] == "hit"
    src.write_bytes(src.read_bytes().replace(b"number 7", b"number 8", 1))
    changed = prepare_splits(cfg)
    assert changed.cache["cache"] == "miss" and "number 8" in " ".join(changed.corpus.train.texts)


def test_hf_sources_are_not_cached(tiny_cfg) -> None:
    cfg = tiny_cfg("data.source=hf:imdb")
    assert source_fingerprint(cfg.data) == (None, "a Hugging Face dataset has no local file to fingerprint")


def test_ragged_rows_and_texts() -> None:
    rows = Ragged(np.arange(6, dtype=np.int32), np.array([0, 2, 2, 6]))
    assert len(rows) == 3 and rows[1].size == 0 and rows[-1].tolist() == [2, 3, 4, 5]
    assert [r.tolist() for r in rows[0:2]] == [[0, 1], []]
    with pytest.raises(IndexError):
        rows[3]
    words = ["zebra", "", "naïve"]
    blob = "".join(words).encode()
    texts = Texts(np.frombuffer(blob, dtype=np.uint8), np.array([0, 5, 5, len(blob)]))
    assert list(texts) == words and texts[2] == "naïve" and texts[:2] == words[:2]


def test_second_run_reports_a_hit(tiny_cfg) -> None:
    a = run_training(tiny_cfg("train.max_steps=2", "train.run_id=a"), time.perf_counter())
    b = run_training(tiny_cfg("train.max_steps=2", "train.run_id=b"), time.perf_counter())
    assert (a["data"]["cache"], b["data"]["cache"]) == ("miss", "hit")
    assert b["data"]["tokenizer"]["source"] == "cache-hit" and b["perf"]["data_prep_s"] >= 0
    assert a["data"]["data_fingerprint"] == b["data"]["data_fingerprint"]
    assert a["quality"]["final_train_loss"] == b["quality"]["final_train_loss"]  # the same data, the same run
    assert Path(b["data"]["tokenizer"]["run_copy"]).is_file()


def test_resume_refuses_another_tokenizer(tiny_cfg) -> None:
    cfg = tiny_cfg("train.max_steps=10", "train.checkpoint_every=5", "train.run_id=r")
    report = run_training(cfg, time.perf_counter())
    run_dir = Path(report["run_dir"])
    ckpt = list_checkpoints(run_dir)[0]
    # the caches are lost and another vocabulary appears where the tokenizer was (e.g. another library version)
    tok_cache = Path(report["data"]["tokenizer"]["path"])
    other = train_wordpiece([f"completely different words {i} zzz qqq" for i in range(300)], 200)
    other.save(str(tok_cache))
    for entry in (Path(cfg.data.cache_dir) / "data").iterdir():
        for f in entry.iterdir():
            f.unlink()
        entry.rmdir()
    with pytest.raises(UserError, match="trained with tokenizer .* resume with the run's own tokenizer") as err:
        run_training(cfg, time.perf_counter(), resume=str(ckpt))
    assert f"data.tokenizer_path={run_dir / 'tokenizer.json'}" in str(err.value)
    # the fix it names works: the run's own copy of its tokenizer
    cfg.data.tokenizer_path = str(run_dir / "tokenizer.json")
    resumed = run_training(cfg, time.perf_counter(), resume=str(ckpt))
    assert resumed["resumed_from"]["step"] == 5 and resumed["status"] == "completed"
    assert resumed["data"]["tokenizer"]["fingerprint"] == report["data"]["tokenizer"]["fingerprint"]
    assert json.loads((run_dir / "report.json").read_text())["resumed_from"]["step"] == 5

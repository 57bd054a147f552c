import csv
from pathlib import Path

import pytest

from tests.conftest import write_jsonl
from train.config import DataConfig
from train.data.sources import load_corpus, split_of, stable_fraction
from train.errors import UserError


def test_split_is_stable_across_processes_and_versions() -> None:
    # Fixed values: BLAKE2b does not depend on PYTHONHASHSEED, platform or Python version.
    assert stable_fraction("n:02084071") == pytest.approx(0.3101113882, abs=1e-9)
    assert [split_of(k, 0.05, 0.05) for k in ("n:02084071", "v:01835496", "a:00001740")] == ["train", "train", "train"]
    fractions = [stable_fraction(f"n:{i}") for i in range(20000)]
    test = sum(f < 0.05 for f in fractions) / len(fractions)
    assert 0.045 < test < 0.055


def test_wordnet_split_is_deterministic(wndb: Path) -> None:
    a = load_corpus(DataConfig(wordnet_dir=str(wndb)))
    b = load_corpus(DataConfig(wordnet_dir=str(wndb)))
    assert a.train.texts == b.train.texts and a.test.texts == b.test.texts
    assert len(a.train) + len(a.validation) + len(a.test) == 241
    assert a.num_classes == 45 and a.label_names[5] == "noun.animal"


def test_max_samples_takes_a_mixed_subset(wndb: Path) -> None:
    c = load_corpus(DataConfig(wordnet_dir=str(wndb), max_samples=40))
    assert len(c.train) == 40 and len(c.validation) == 4
    assert len(set(c.train.labels.tolist())) >= 3  # not only the nouns that come first in the files


def test_jsonl_string_labels(tmp_path: Path) -> None:
    recs = [{"text": f"sample {i}", "label": "pos" if i % 2 else "neg"} for i in range(100)]
    c = load_corpus(DataConfig(source=str(write_jsonl(tmp_path / "d.jsonl", recs))))
    assert c.label_names == ["neg", "pos"]
    assert set(c.train.labels.tolist()) == {0, 1}


def test_csv_and_parquet_with_custom_columns(tmp_path: Path) -> None:
    rows = [{"sentence": f"row {i}", "y": i % 3} for i in range(60)]
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["sentence", "y"])
        w.writeheader()
        w.writerows(rows)
    c = load_corpus(DataConfig(source=str(tmp_path / "d.csv"), text_field="sentence", label_field="y"))
    assert c.num_classes == 3
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"sentence": [r["sentence"] for r in rows], "y": [r["y"] for r in rows]}),
                   tmp_path / "d.parquet")
    p = load_corpus(DataConfig(source=str(tmp_path / "d.parquet"), text_field="sentence", label_field="y"))
    assert p.train.texts == c.train.texts and (p.train.labels == c.train.labels).all()


def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": 0}, '{"text": "b", "label": ',
                                              {"text": "c", "label": 1}])
    with pytest.raises(UserError, match=r"d\.jsonl:2: malformed JSON"):
        load_corpus(DataConfig(source=str(path)))


def test_unknown_column_names_the_available_ones(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"sentence": "a", "label": 0}])
    with pytest.raises(UserError,
                       match=r"d\.jsonl:1: no text field 'text' \(fields: sentence, label\); set data.text_field"):
        load_corpus(DataConfig(source=str(path)))
    with open(tmp_path / "d.csv", "w") as f:
        f.write("sentence,label\nhello,0\n")
    with pytest.raises(UserError, match=r"no text column 'text' \(columns: sentence, label\)"):
        load_corpus(DataConfig(source=str(tmp_path / "d.csv")))


def test_empty_text_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine", "label": 0}, {"text": "   ", "label": 1}])
    with pytest.raises(UserError, match=r"d\.jsonl:2: empty text"):
        load_corpus(DataConfig(source=str(path)))


def test_label_out_of_range(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1},
                                              {"text": "c", "label": 7}])
    with pytest.raises(UserError, match=r"d\.jsonl:3: label 7 is out of range \[0, 2\)"):
        load_corpus(DataConfig(source=str(path), num_classes=2))
    neg = write_jsonl(tmp_path / "n.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": -1}])
    with pytest.raises(UserError, match=r"n\.jsonl:2: label -1 is out of range"):
        load_corpus(DataConfig(source=str(neg)))


def test_mixed_label_kinds_and_non_utf8(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": "x"}])
    with pytest.raises(UserError, match=r"d\.jsonl:2: labels mix strings and integers"):
        load_corpus(DataConfig(source=str(path)))
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    with pytest.raises(UserError, match=r"b\.jsonl:2: not valid UTF-8"):
        load_corpus(DataConfig(source=str(bad)))


def test_missing_file_and_unknown_type(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        load_corpus(DataConfig(source=str(tmp_path / "nope.jsonl")))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(UserError, match="unsupported file type"):
        load_corpus(DataConfig(source=str(tmp_path / "d.txt")))


def test_hf_source_without_datasets_installed(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(UserError, match="pip install datasets"):
        load_corpus(DataConfig(source="hf:imdb"))

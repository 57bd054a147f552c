from pathlib import Path

import pytest

from tests.conftest import write_wndb
from train.config import DataConfig
from train.data import wordnet
from train.data.sources import load_corpus
from train.errors import UserError


def test_parse_multiword_lemma_and_adjective_satellite(tmp_path: Path) -> None:
    root = write_wndb(tmp_path / "wn", [
        ("noun", "n", 5, ["domestic_dog", "Canis_familiaris"], "a member of the genus Canis"),
        ("adj", "s", 0, ["handy", "ready_to_hand(p)"], "easy to reach"),
        ("verb", "v", 38, ["run"], "move fast"),
        ("adv", "r", 2, ["quickly"], "with speed"),
    ])
    synsets = {s.pos: s for s in wordnet.iter_synsets(root)}
    assert synsets["n"].lemmas == ("domestic dog", "Canis familiaris")
    assert synsets["n"].text == "domestic dog, Canis familiaris: a member of the genus Canis"
    assert synsets["s"].lemmas == ("handy", "ready to hand")  # (p) marker removed
    assert wordnet.LEXNAMES[synsets["s"].lex_filenum] == "adj.all"
    assert wordnet.LEXNAMES[synsets["v"].lex_filenum] == "verb.motion"
    # offsets are the byte offsets written by the fixture
    raw = (root / "data.noun").read_bytes()
    assert raw[synsets["n"].offset:].startswith(f"{synsets['n'].offset:08d}".encode())


def test_lexnames_are_the_45_standard_names() -> None:
    assert len(wordnet.LEXNAMES) == 45
    assert wordnet.LEXNAMES[5] == "noun.animal" and wordnet.LEXNAMES[44] == "adj.ppl"


def test_missing_database_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WNHOME", str(tmp_path / "nowhere"))
    with pytest.raises(UserError) as err:
        wordnet.find_wordnet_dir(str(tmp_path / "nowhere"))
    assert "apt-get install wordnet-base" in str(err.value) and "WNHOME" in str(err.value)


def test_wnhome_dict_subdirectory_is_searched(tmp_path: Path, monkeypatch) -> None:
    write_wndb(tmp_path / "wnhome" / "dict", [("noun", "n", 5, ["dog"], "an animal")])
    monkeypatch.setenv("WNHOME", str(tmp_path / "wnhome"))
    assert wordnet.find_wordnet_dir() == tmp_path / "wnhome" / "dict"


def test_malformed_data_line_names_file_and_line(tmp_path: Path) -> None:
    root = write_wndb(tmp_path / "wn", [("noun", "n", 5, ["dog"], "an animal")])
    with open(root / "data.noun", "a") as f:
        f.write("garbage line without fields\n")
    with pytest.raises(UserError, match=r"data\.noun:3"):
        list(wordnet.iter_synsets(root))


@pytest.mark.skipif(not Path("/usr/share/wordnet/data.noun").is_file(), reason="wordnet-base not installed")
def test_real_wordnet_has_117659_examples_in_45_classes() -> None:
    corpus = load_corpus(DataConfig(wordnet_dir="/usr/share/wordnet"))
    total = len(corpus.train) + len(corpus.validation) + len(corpus.test)
    assert total == 117659
    assert corpus.num_classes == 45
    present = set(corpus.train.labels.tolist())
    assert len(present) == 45
    assert 0.88 < len(corpus.train) / total < 0.92

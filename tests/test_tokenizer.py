import subprocess
import sys
from pathlib import Path

import numpy as np

from train.data.tokenizer import encode, load_or_train

TEXTS = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(200)]


def test_cache_miss_then_hit(tmp_path: Path) -> None:
    tok, info = load_or_train(TEXTS, 120, str(tmp_path))
    assert info["source"] == "trained" and Path(info["path"]).is_file()
    tok2, info2 = load_or_train(TEXTS, 120, str(tmp_path))
    assert info2["source"] == "cache-hit" and info2["fingerprint"] == info["fingerprint"]
    _, info3 = load_or_train(TEXTS[:-1], 120, str(tmp_path))  # other data → another cache entry
    assert info3["source"] == "trained" and info3["path"] != info["path"]
    assert [tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]")] == [0, 1, 2, 3]


def test_truncation_is_counted_and_keeps_sep(tmp_path: Path) -> None:
    tok, _ = load_or_train(TEXTS, 120, str(tmp_path))
    texts = ["fox", "the quick brown fox jumps over the lazy dog " * 5]
    split = encode(tok, texts, np.array([0, 1]), max_len=12)
    assert split.truncated == 1
    assert split.lengths.tolist() == [3, 12]
    assert split.ids[1][0] == 2 and split.ids[1][-1] == 3  # [CLS] … [SEP]


def test_user_tokenizer_file(tmp_path: Path) -> None:
    tok, info = load_or_train(TEXTS, 120, str(tmp_path))
    tok.save(str(tmp_path / "tokenizer.json"))
    _, user = load_or_train(TEXTS, 999, str(tmp_path), tokenizer_path=str(tmp_path / "tokenizer.json"))
    assert user["source"] == "user" and user["fingerprint"] == info["fingerprint"]


# Random words over a small alphabet: many merges tie on count, which is where tokenizers' trainer used to
# depend on hash-map order (three processes gave three vocabularies before the fix).
TRAIN_IN_A_PROCESS = """
import random
from train.data.tokenizer import tokenizer_fingerprint, train_wordpiece
rng = random.Random(0)
texts = [" ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7)))
                  for _ in range(rng.randint(3, 12))) for _ in range(300)]
print(tokenizer_fingerprint(train_wordpiece(texts, 300)))
"""


def test_same_texts_same_tokenizer_in_every_process() -> None:
    root = Path(__file__).resolve().parent.parent
    prints = {subprocess.run([sys.executable, "-c", TRAIN_IN_A_PROCESS], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip() for _ in range(3)}
    assert len(prints) == 1, prints


def test_seeded_continuing_tokens_are_ordinary_vocabulary() -> None:
    from train.data.tokenizer import SPECIAL_TOKENS, train_wordpiece

    tok = train_wordpiece(TEXTS, 120)
    assert [t.content for t in tok.get_added_tokens_decoder().values()] == SPECIAL_TOKENS  # only the real ones
    assert tok.token_to_id("##x") is not None  # a continuing token, part of the vocabulary
    tokens = tok.encode("fox ##x").tokens  # the literal text is split like any text, not matched as a special token
    assert "##x" not in tokens and tokens[-2:] == ["x", "[SEP]"], tokens

"""Tokenization with Hugging Face ``tokenizers``: a WordPiece model trained on the training split.

BERT's recipe (Devlin et al. 2019): BertNormalizer (lower-case, strip accents), BertPreTokenizer,
WordPiece with ``##`` continuation prefix, special tokens ``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3``,
and a ``[CLS] text [SEP]`` template. The trained tokenizer is cached under
``<cache_dir>/tokenizers/<fingerprint>.json``, keyed by a SHA-256 of the training texts and the
settings, so a second run with the same data loads it instead of training again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from train.data.word_cache import WordCacheEncoder
from train.errors import UserError, atomic_path

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
FORMAT_VERSION = 2  # bump when the training recipe changes, so old cache entries are not reused


@dataclass
class TokenizedSplit:
    """Token ids per example.

    Attributes:
        ids: list of int32 arrays, each ``[L_i]`` with ``L_i ≤ max_len``, special tokens included.
        labels: int64 ``[N]``: a classifier's class ids; for a causal LM (train/data/causal_prepare.py) each
            sample's ``n_prompt``, the number of leading prompt tokens that are context, not targets.
        lengths: int32 ``[N]``, ``lengths[i] == len(ids[i])`` (after truncation).
        truncated: how many examples were longer than ``max_len`` and were cut.
    """

    ids: list[np.ndarray]
    labels: np.ndarray
    lengths: np.ndarray
    truncated: int
    unk_only_words: Optional[int] = None
    """``[UNK]`` tokens in the encoded texts (before truncation): with WordPiece each is one whole word the vocabulary
    cannot spell (longer than 100 characters, or a character it never saw). None for a cache entry written before it was
    counted."""
    dropped: int = 0
    """Causal LM: samples left out because no target fits in ``max_len`` (a completion truncated away)."""

    def __len__(self) -> int:
        return len(self.ids)


def texts_fingerprint(texts: Iterable[str]) -> str:
    """SHA-256 (hex, first 16 chars) of the texts in order; identifies a data split."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """SHA-256 (hex, first 16 chars) of the tokenizer's JSON serialisation."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()[:16]


@dataclass
class TrainingTexts:
    """The training split's texts for :func:`load_or_train` without holding them in memory: ``batches()`` yields them
    in order as lists of str, ``fingerprint`` is their :func:`texts_fingerprint` and ``chars`` every character in
    them (train/data/prepare.py computes both while writing the texts)."""

    batches: Callable[[], Iterator[list[str]]]
    fingerprint: str
    chars: set[str]


def continuing_alphabet(texts: Iterable[str], normalizer: normalizers.Normalizer,
                        chars: Optional[set[str]] = None) -> list[str]:
    """Every character that can follow another inside a word after ``normalizer``, sorted: the normalised
    alphabet less whitespace and BERT punctuation (which BertPreTokenizer splits off as words of their own).
    ``chars``, when given, is the set of characters in ``texts`` (then ``texts`` is not read).

    A superset is harmless (at most a few unused ``##c`` tokens); normalising each distinct character alone
    is exact because the BERT normalizer works character by character.
    """
    if chars is None:
        chars = set()
        for t in texts:  # one text at a time: a set per text, for every text at once, costs ~2 KB a text
            chars.update(t)
    out: set[str] = set()
    for ch in chars:
        out.update(normalizer.normalize_str(ch))
    return sorted(c for c in out if not c.isspace() and not _is_punctuation(c))


def _is_punctuation(ch: str) -> bool:
    """BERT's definition (Rust ``is_bert_punc``): ASCII punctuation or a Unicode ``P*`` category."""
    import unicodedata

    return (ch.isascii() and not ch.isalnum() and ch.isprintable() and not ch.isspace()) \
        or unicodedata.category(ch).startswith("P")


def train_wordpiece(texts: Sequence[str] | TrainingTexts, vocab_size: int) -> Tokenizer:
    """Train a BERT-style WordPiece tokenizer on ``texts`` (a list, or :class:`TrainingTexts` streamed in batches);
    the same texts give the same tokenizer in every process.

    ``tokenizers``' trainer is not deterministic across processes on its own (huggingface/tokenizers#1794):
    it assigns ids to continuing-subword tokens (``##c``) in hash-map iteration order, and those ids break
    ties between merges of equal count. So every ``##c`` of the alphabet is given an id up front, in sorted
    order (passed as extra special tokens, which the trainer numbers first), and the trained vocabulary is
    then rebuilt into a tokenizer whose only special tokens are :data:`SPECIAL_TOKENS`.
    """
    normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    alphabet = continuing_alphabet((), normalizer, texts.chars) if isinstance(texts, TrainingTexts) \
        else continuing_alphabet(texts, normalizer)
    seeded = [f"##{c}" for c in alphabet]
    draft = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    draft.normalizer = normalizer
    draft.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + seeded,
                                        min_frequency=2, show_progress=False)
    if isinstance(texts, TrainingTexts):  # word counts do not depend on how the texts are batched
        draft.train_from_iterator(texts.batches(), trainer=trainer)
    else:
        draft.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok = Tokenizer(models.WordPiece(vocab=draft.get_vocab(), unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(SPECIAL_TOKENS)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.decoder = decoders.WordPiece()
    return tok


def load_or_train(train_texts: Sequence[str] | TrainingTexts, vocab_size: int, cache_dir: str,
                  tokenizer_path: Optional[str] = None) -> tuple[Tokenizer, dict]:
    """Return the tokenizer and facts about where it came from (``train_texts``: a list, or :class:`TrainingTexts`).

    The facts dict has ``source`` (``user``, ``cache-hit``, ``trained``), ``path``, ``vocab_size``
    and ``fingerprint``.

    Raises:
        UserError: a user-supplied ``tokenizer_path`` is missing or not a tokenizers JSON file.
    """
    if tokenizer_path is not None:
        p = Path(tokenizer_path)
        if not p.is_file():
            raise UserError(f"data.tokenizer_path={tokenizer_path!r}: no such file "
                            "(expected a Hugging Face tokenizer.json)")
        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as exc:  # tokenizers raises a generic Exception for bad JSON
            raise UserError(f"{p}: not a Hugging Face tokenizers JSON file ({exc})") from None
        return tok, {"source": "user", "path": str(p), "vocab_size": tok.get_vocab_size(),
                     "fingerprint": tokenizer_fingerprint(tok)}
    texts_fp = train_texts.fingerprint if isinstance(train_texts, TrainingTexts) else texts_fingerprint(train_texts)
    key = hashlib.sha256(f"v{FORMAT_VERSION}:{vocab_size}:{texts_fp}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"wordpiece-{vocab_size}-{key}.json"
    tok, source = cached_tokenizer(path, lambda: train_wordpiece(train_texts, vocab_size))
    return tok, {"source": source, "path": str(path), "vocab_size": tok.get_vocab_size(),
                 "fingerprint": tokenizer_fingerprint(tok)}


def cached_tokenizer(path: Path, train: Callable[[], Tokenizer]) -> tuple[Tokenizer, str]:
    """``(tokenizer, "cache-hit")`` read from ``path``, or ``(train(), "trained")`` saved there (atomically; a corrupt
    entry is retrained, an unwritable cache costs a retrain next time, nothing more)."""
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path)), "cache-hit"
        except Exception:  # a corrupt cache entry is retrained, never fatal
            pass
    tok = train()
    try:
        with atomic_path(path) as tmp:
            tok.save(str(tmp))
    except OSError:
        pass
    return tok, "trained"


def pad_id(tok: Tokenizer) -> int:
    """The id used for padding: ``[PAD]`` (or ``<pad>``) if the vocabulary has it, else 0."""
    for name in ("[PAD]", "<pad>"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return 0


def unk_id(tok: Tokenizer) -> Optional[int]:
    """The id of the model's unknown token (``[UNK]``, ``<unk>``), or None when it has none."""
    name = getattr(tok.model, "unk_token", None)
    for candidate in (name, "[UNK]", "<unk>"):
        i = tok.token_to_id(candidate) if isinstance(candidate, str) else None
        if i is not None:
            return i
    return None


def encode_chunk(tok: Tokenizer, texts: list[str], max_len: int,
                 words: Optional[WordCacheEncoder] = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(ids, lengths, truncated, unk)`` for one batch of texts: the ids of every text back to back (int32) and each
    text's length (int64), each text cut to ``max_len`` tokens keeping its final special token (done here rather than
    by the tokenizer so truncations are counted exactly); ``unk`` counts the ``[UNK]`` tokens before the cut.
    ``words``: the same ids through a word cache (:class:`WordCacheEncoder`). Call ``tok.no_truncation()`` and
    ``tok.no_padding()`` first."""
    if words is not None:
        flat, lengths = words(texts)
    else:
        batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast (tokenizers >= 0.20): no offsets
        flat, lengths = _flatten([enc.ids for enc in batch(texts)])
    unk = unk_id(tok)
    unks = int(np.count_nonzero(flat == unk)) if unk is not None else 0
    long = lengths > max_len
    if not long.any():
        return flat, lengths, 0, unks
    pos = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = (pos < max_len - 1) | (pos == np.repeat(lengths, lengths) - 1)  # = seq[:max_len - 1] + seq[-1:]
    return flat[keep], np.minimum(lengths, max_len), int(long.sum()), unks


def _flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    return np.fromiter(chain.from_iterable(seqs), dtype=np.int32, count=int(lengths.sum())), lengths


def encode(tok: Tokenizer, texts: Sequence[str], labels: np.ndarray, max_len: int) -> TokenizedSplit:
    """Tokenize ``texts`` and truncate each to ``max_len`` tokens, keeping the final special token (every
    encoding at once: for a few texts; prepared data is encoded in chunks, train/data/prepare.py)."""
    tok.no_truncation()
    tok.no_padding()
    flat, lengths, truncated, unks = encode_chunk(tok, list(texts), max_len)
    ids = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
    lengths = lengths.astype(np.int32)
    return TokenizedSplit(ids=ids, labels=np.asarray(labels, dtype=np.int64), lengths=lengths, truncated=truncated,
                          unk_only_words=unks)

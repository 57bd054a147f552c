"""Tokenization with Hugging Face ``tokenizers``: a WordPiece model trained on the training split.

BERT's recipe (Devlin et al. 2019): BertNormalizer (lower-case, strip accents), BertPreTokenizer,
WordPiece with ``##`` continuation prefix, special tokens ``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3``,
and a ``[CLS] text [SEP]`` template. The trained tokenizer is cached under
``<cache_dir>/tokenizers/<fingerprint>.json``, keyed by a SHA-256 of the training texts and the
settings, so a second run with the same data loads it instead of training again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from train.errors import UserError, atomic_path

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
FORMAT_VERSION = 2  # bump when the training recipe changes, so old cache entries are not reused


@dataclass
class TokenizedSplit:
    """Token ids per example.

    Attributes:
        ids: list of int32 arrays, each ``[L_i]`` with ``L_i ≤ max_len``, special tokens included.
        labels: int64 ``[N]`` class ids.
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
        for t in texts:  # one text at a time: a set per text for every text at once took 2 KB a text
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
    if path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
            source = "cache-hit"
        except Exception:  # a corrupt cache entry is retrained, never fatal
            tok, source = None, "trained"
    else:
        tok, source = None, "trained"
    if tok is None:
        tok = train_wordpiece(train_texts, vocab_size)
        try:
            with atomic_path(path) as tmp:
                tok.save(str(tmp))
        except OSError:
            pass  # an unwritable cache costs a retrain next time, nothing more
    return tok, {"source": source, "path": str(path), "vocab_size": tok.get_vocab_size(),
                 "fingerprint": tokenizer_fingerprint(tok)}


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


SEPARABLE_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFD", "NFKD", "StripAccents"}
SEPARABLE_PRE_TOKENIZERS = {"BertPreTokenizer", "WhitespaceSplit", "Whitespace"}
SEPARABLE_MODELS = {"WordPiece", "WordLevel", "BPE"}


def _steps(component: Optional[dict], key: str) -> list[dict]:
    if component is None:
        return []
    return [s for c in component[key] for s in _steps(c, key)] if component.get("type") == "Sequence" else [component]


class WordCacheEncoder:
    """The ids of :func:`encode_chunk`, computed once per distinct space-separated piece of text: for the tokenizers
    whose output on ``"A B"`` is always their output on ``A`` then on ``B`` between the template's special tokens.

    That holds when every step works within a space-separated piece: a normalizer that maps characters one at a time
    (``BertNormalizer``, ``Lowercase``, ``NFD``/``NFKD``: canonical reordering never crosses a space, a starter;
    ``StripAccents``), a pre-tokenizer that splits on whitespace (``BertPreTokenizer``, ``Whitespace``,
    ``WhitespaceSplit``), a per-word model (``WordPiece``, ``WordLevel``, ``BPE``), added tokens without whitespace
    or stripping, and a post-processor that only adds special tokens around the text. :meth:`for_tokenizer` checks
    exactly that and returns None otherwise; each call also checks its first :data:`CHECK` texts against the
    tokenizer itself and reports a difference (:attr:`mismatch`), so the caller can encode everything directly instead.
    Words are encoded in one batched call per chunk; on word-heavy text (2 M rows) this is ~5x faster than encoding
    every text, which normalizes and looks up each word again."""

    MAX_WORDS = 1_000_000
    """Distinct pieces kept (then the cache starts again)."""
    MAX_IDS = 16_000_000
    """Token ids kept for them (64 MB)."""
    MAX_PIECE = 256
    """A text with a longer space-separated piece is encoded as one piece, not kept."""
    CHECK = 64
    """Texts of each call also encoded directly, to compare."""

    def __init__(self, tok: Tokenizer, prefix: list[int], suffix: list[int]) -> None:
        self.tok, self.prefix, self.suffix = tok, prefix, suffix
        self.mismatch: Optional[str] = None
        self._batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        self._clear()

    def _clear(self) -> None:
        self.index: dict[str, int] = {}  # piece -> its number; its ids are ids[offsets[n]:offsets[n + 1]]
        self.ids = array("i")
        self.offsets = array("q", [0])

    def _add(self, pieces: list[str]) -> None:
        for k, e in enumerate(self._batch(pieces, add_special_tokens=False)):
            self.index[pieces[k]] = len(self.offsets) - 1
            self.ids.extend(e.ids)
            self.offsets.append(len(self.ids))

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer) -> Optional[WordCacheEncoder]:
        import json

        try:
            spec = json.loads(tok.to_str())
        except Exception:  # a tokenizer that cannot serialise itself: encode directly
            return None
        if spec.get("truncation") or spec.get("padding"):
            return None
        if any(s.get("type") not in SEPARABLE_NORMALIZERS for s in _steps(spec.get("normalizer"), "normalizers")):
            return None
        pre = _steps(spec.get("pre_tokenizer"), "pretokenizers")
        if not pre or any(s.get("type") not in SEPARABLE_PRE_TOKENIZERS for s in pre):
            return None
        model = spec.get("model") or {}
        if model.get("type") not in SEPARABLE_MODELS or model.get("dropout"):  # BPE dropout: random merges
            return None
        if (spec.get("post_processor") or {}).get("type") not in (None, "TemplateProcessing", "BertProcessing"):
            return None
        for t in spec.get("added_tokens") or []:
            if t.get("lstrip") or t.get("rstrip") or t.get("single_word") \
                    or any(c.isspace() for c in t.get("content", " ")):
                return None
        batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        probes = ["a", "b c", "the end."]
        full = [e.ids for e in batch(probes)]
        bare = [e.ids for e in batch(probes, add_special_tokens=False)]
        cut = len(full[0]) - len(bare[0])
        for i in range(cut + 1):  # where the text sits between the special tokens
            prefix, suffix = full[0][:i], full[0][i + len(bare[0]):]
            if all(f == prefix + b + suffix for f, b in zip(full, bare)):
                return cls(tok, prefix, suffix)
        return None

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)`` of ``texts`` as :func:`encode_chunk` has them, before truncation."""
        pieces = [t.split(" ") for t in texts]
        whole = [k for k, t in enumerate(texts)
                 if len(t) > self.MAX_PIECE and max(map(len, pieces[k])) > self.MAX_PIECE]
        for k in whole:
            pieces[k] = [texts[k]]
        new = set(chain.from_iterable(pieces))
        new.difference_update(self.index.keys())
        if len(self.index) + len(new) > self.MAX_WORDS or len(self.ids) > self.MAX_IDS:
            self._clear()
            new = set(chain.from_iterable(pieces))
        keep = [w for w in new if len(w) <= self.MAX_PIECE]
        if keep:
            self._add(keep)
        mark_words, mark_ids = len(self.offsets), len(self.ids)
        if len(keep) < len(new):
            self._add([w for w in new if len(w) > self.MAX_PIECE])  # for this call only
        try:
            number = np.fromiter(map(self.index.__getitem__, chain.from_iterable(pieces)), dtype=np.int64,
                                 count=sum(map(len, pieces)))
            w_off = np.frombuffer(self.offsets, dtype=np.int64)
            w_ids = np.frombuffer(self.ids, dtype=np.int32) if len(self.ids) else np.zeros(0, np.int32)
            piece_len = w_off[number + 1] - w_off[number]
            bare = w_ids[np.repeat(w_off[number] - (np.cumsum(piece_len) - piece_len), piece_len)
                         + np.arange(int(piece_len.sum()))]
            del w_off, w_ids  # no buffer exported while the arrays change size
        finally:
            if len(self.offsets) > mark_words:
                try:
                    del self.offsets[mark_words:]
                    del self.ids[mark_ids:]
                    for w in new:
                        if len(w) > self.MAX_PIECE:
                            del self.index[w]
                except BufferError:  # an exception left a view of the arrays alive: start again
                    self._clear()
        counts = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        text_len = np.add.reduceat(piece_len, np.cumsum(counts) - counts) if len(texts) else np.zeros(0, np.int64)
        pre, suf = len(self.prefix), len(self.suffix)
        lengths = text_len + pre + suf
        starts = np.cumsum(lengths) - lengths
        flat = np.empty(int(lengths.sum()), dtype=np.int32)
        if pre:
            flat[(starts[:, None] + np.arange(pre)).ravel()] = np.tile(np.asarray(self.prefix, np.int32), len(texts))
        if suf:
            flat[(starts[:, None] + pre + text_len[:, None] + np.arange(suf)).ravel()] = \
                np.tile(np.asarray(self.suffix, np.int32), len(texts))
        flat[np.repeat(starts + pre - (np.cumsum(text_len) - text_len), text_len) + np.arange(bare.size)] = bare
        if self.mismatch is None:
            sample = texts[: self.CHECK]
            for k, want in enumerate(e.ids for e in self._batch(sample)):
                got = flat[starts[k]:starts[k] + lengths[k]].tolist()
                if got != want:
                    self.mismatch = f"{sample[k][:60]!r}: {got[:12]} != {want[:12]}"
                    break
        return flat, lengths


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

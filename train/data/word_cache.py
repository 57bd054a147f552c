"""A word cache for tokenizers that work space-separated piece by piece: each distinct piece is encoded once
(:class:`WordCacheEncoder`); :func:`train.data.tokenizer.encode_chunk` uses it for prepared data."""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Optional

import numpy as np
from tokenizers import Tokenizer

SEPARABLE_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFD", "NFKD", "StripAccents"}
SEPARABLE_PRE_TOKENIZERS = {"BertPreTokenizer", "WhitespaceSplit", "Whitespace"}
SEPARABLE_MODELS = {"WordPiece", "WordLevel", "BPE"}


def _steps(component: Optional[dict], key: str) -> list[dict]:
    if component is None:
        return []
    return [s for c in component[key] for s in _steps(c, key)] if component.get("type") == "Sequence" else [component]


class WordCacheEncoder:
    """The ids of :func:`~train.data.tokenizer.encode_chunk`, computed once per distinct space-separated piece of
    text: for the tokenizers whose output on ``"A B"`` is always their output on ``A`` then on ``B`` between the
    template's special tokens.

    That holds when every step works within a space-separated piece: a normalizer that maps characters one at a time
    (``BertNormalizer``, ``Lowercase``, ``NFD``/``NFKD``: canonical reordering never crosses a space, a starter;
    ``StripAccents``), a pre-tokenizer that splits on whitespace (``BertPreTokenizer``, ``Whitespace``,
    ``WhitespaceSplit``), a per-word model (``WordPiece``, ``WordLevel``, ``BPE``), added tokens without whitespace
    or stripping, and a post-processor that only adds special tokens around the text. :meth:`for_tokenizer` checks
    exactly that and returns None otherwise; each call also checks its first :data:`CHECK` texts against the
    tokenizer itself and reports a difference (:attr:`mismatch`), so the caller can encode everything directly instead.
    Words are encoded in one batched call per chunk: on word-heavy text, where words repeat, that is faster than
    encoding every text, which normalizes and looks up each word again (docs/data.md)."""

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
        """``(ids, lengths)`` of ``texts`` as :func:`~train.data.tokenizer.encode_chunk` has them, before truncation."""
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

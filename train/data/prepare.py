"""Prepared data built in bounded memory: a source streamed into a cache entry (the format of train/data/cache.py).

Nothing holds all the texts, encodings or per-row Python objects at once (holding the texts, one tokenizers
``Encoding`` and one numpy array per text makes memory grow with every row: docs/data.md has the figures):

1. one pass over the source (:func:`~train.data.sources.scan_source`) validates each row, appends its text as UTF-8
   to a scratch file and keeps only its split hash and label (compact arrays, ~24 bytes a row);
2. per split, the texts are gathered in the split's order (by stable hash) into ``<split>.texts.npy``, chunk by chunk;
   the training split's fingerprint and alphabet are computed on the way;
3. the tokenizer is loaded, or trained from the training texts read back in batches (``train_from_iterator``);
4. per split, the texts are encoded :data:`CHUNK_ROWS` at a time (a batched fast-tokenizer call; for tokenizers that
   work word by word, through a cache of each distinct word's ids: :class:`~train.data.word_cache.WordCacheEncoder`)
   and each chunk's ids appended to ``<split>.ids.npy``.

The files are byte for byte those the in-memory build wrote (``numpy.save`` headers included), so entries written
before are read as they were. Progress (rows/s) is drawn on stderr when ``train.progress`` is true and it is a terminal.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import shutil
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

import train.data.cache as cache  # the module itself: train/data/__init__.py imports this one
from train.config import RunConfig
from train.data.sources import SPLITS, Scan, scan_source
from train.data.tokenizer import TrainingTexts, encode_chunk, load_or_train, pad_id
from train.data.word_cache import WordCacheEncoder
from train.shutdown import pause_point
from train.tools.progress import progress_bar

CHUNK_ROWS = 8192
"""Texts per chunk: gathered, read back, encoded (one ``encode_batch`` call) and written at a time."""
FLUSH_BYTES = 8 << 20
SCRATCH = "rows.scratch"


def npy_header(dtype: np.dtype, n: int) -> bytes:
    """The header ``numpy.save`` writes for a 1-D C-ordered array of ``n`` elements of ``dtype``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (n,)})
    return buf.getvalue()


class NpyAppender:
    """A 1-D ``.npy`` file written in pieces whose total length is known only at the end: the data goes after a
    header-sized gap and the header is written last (numpy pads the shape so the header's size does not depend on
    it)."""

    def __init__(self, path: Path, dtype: type) -> None:
        self.path, self.dtype, self.n = path, np.dtype(dtype), 0
        self.gap = len(npy_header(self.dtype, 0))
        self.f = open(path, "wb")
        self.f.write(b"\0" * self.gap)

    def write(self, data: np.ndarray | bytes) -> None:
        raw = data if isinstance(data, bytes) else np.ascontiguousarray(data, dtype=self.dtype).tobytes()
        self.f.write(raw)
        self.n += len(raw) // self.dtype.itemsize

    def close(self) -> None:
        header = npy_header(self.dtype, self.n)
        if len(header) == self.gap:
            self.f.seek(0)
            self.f.write(header)
            self.f.close()
            return
        self.f.close()  # a header of another size (not with numpy's padding): copy the data behind it
        moved = self.path.with_suffix(".part")
        self.path.rename(moved)
        with open(moved, "rb") as src, open(self.path, "wb") as dst:
            dst.write(header)
            src.seek(self.gap)
            shutil.copyfileobj(src, dst, 1 << 24)
        moved.unlink()


class _TextSink:
    """Receives each row's text (``scan_source``'s ``on_text``): UTF-8 bytes appended to the scratch file, lengths
    kept."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.lengths = array("q")
        self.parts: list[bytes] = []
        self.pending = 0

    def __call__(self, text: str) -> None:
        b = text.encode("utf-8")
        self.lengths.append(len(b))
        self.parts.append(b)
        self.pending += len(b)
        if self.pending >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        self.f.write(b"".join(self.parts))
        self.parts, self.pending = [], 0

    def close(self) -> np.ndarray:
        """The byte offsets of the rows in the scratch file (int64 ``[N + 1]``)."""
        self.flush()
        self.f.close()
        return cache._offsets(np.frombuffer(self.lengths, dtype=np.int64) if len(self.lengths) else [])


def _gather(scratch: Path, starts: np.ndarray, ends: np.ndarray, out: Path, train: bool) -> tuple[str, set[str]]:
    """Write the rows ``[starts[k], ends[k])`` of the scratch file, in this order, as ``out`` (a uint8 ``.npy``);
    for the training split also return their :func:`~train.data.tokenizer.texts_fingerprint` and character set."""
    w = NpyAppender(out, np.uint8)
    h = hashlib.sha256()
    seen = np.zeros(0x110000, dtype=bool)
    try:
        with open(scratch, "rb") as f:
            for a in range(0, len(starts), CHUNK_ROWS):
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # mapped per chunk: the pages leave RSS after
                try:
                    parts = [mm[s:e] for s, e in zip(starts[a:a + CHUNK_ROWS].tolist(),
                                                     ends[a:a + CHUNK_ROWS].tolist())]
                finally:
                    mm.close()
                data = b"".join(parts)
                w.write(data)
                if train:
                    h.update(b"\0".join(parts) + b"\0")  # = each text then a NUL, as texts_fingerprint hashes them
                    codes = np.frombuffer(data, np.uint8) if data.isascii() else \
                        np.frombuffer(data.decode("utf-8").encode("utf-32-le"), np.uint32)
                    seen[codes] = True
    finally:
        w.close()
    return h.hexdigest()[:16], {chr(c) for c in np.flatnonzero(seen).tolist()}


def read_texts(path: Path, offsets: np.ndarray, chunk: Optional[int] = None) -> Iterator[list[str]]:
    """The texts of a ``<split>.texts.npy`` written by :func:`_gather` (its byte ``offsets``), ``chunk`` (default
    :data:`CHUNK_ROWS`) at a time."""
    chunk = chunk or CHUNK_ROWS
    gap = len(npy_header(np.dtype(np.uint8), 0))
    with open(path, "rb") as f:
        for a in range(0, len(offsets) - 1, chunk):
            b = min(a + chunk, len(offsets) - 1)
            f.seek(gap + int(offsets[a]))
            data = f.read(int(offsets[b] - offsets[a]))
            rel = (offsets[a:b + 1] - offsets[a]).tolist()
            if data.isascii():  # byte offsets are character offsets: decode once
                s = data.decode("ascii")
                yield [s[i:j] for i, j in zip(rel[:-1], rel[1:])]
            else:
                yield [data[i:j].decode("utf-8") for i, j in zip(rel[:-1], rel[1:])]


@dataclass
class Gathered:
    """A source read into a cache entry's directory, split by split, before tokenization: ``scan`` (the compact
    per-row facts), ``text_offsets`` (per split, the byte offsets of its texts in ``<split>.texts.npy``) and
    ``training`` (the training split's texts for the tokenizer)."""

    scan: Scan
    text_offsets: dict[str, np.ndarray]
    training: TrainingTexts


def gather(cfg: RunConfig, out: Path, scan: Callable[..., Scan] = scan_source) -> Gathered:
    """Steps 1 and 2 (module docstring): read the source with ``scan`` (:func:`~train.data.sources.scan_source`'s
    signature), then write each split's ``texts`` / ``text_offsets`` / ``labels`` (the scan's labels, by row)."""
    d = cfg.data
    shown = cfg.train.progress
    scratch = out / SCRATCH
    sink = _TextSink(scratch)
    try:
        with progress_bar(None, "reading data", shown, unit="row") as bar:  # type: ignore[arg-type]
            scanned: Scan = scan(d, sink, bar.update)
    finally:
        row_offsets = sink.close()
    text_offsets: dict[str, np.ndarray] = {}
    fingerprint, chars = "", set()
    for name in SPLITS:
        idx = scanned.splits[name]
        text_offsets[name] = cache._offsets(row_offsets[idx + 1] - row_offsets[idx])
        fp, ch = _gather(scratch, row_offsets[idx], row_offsets[idx + 1], out / f"{name}.texts.npy", name == "train")
        np.save(out / f"{name}.text_offsets.npy", text_offsets[name])
        np.save(out / f"{name}.labels.npy", scanned.labels[idx])
        if name == "train":
            fingerprint, chars = fp, ch
    scratch.unlink()
    del row_offsets

    train_rows = len(scanned.splits["train"])

    def batches() -> Iterator[list[str]]:
        with progress_bar(train_rows, "training the tokenizer", shown, unit="row") as tbar:
            for texts in read_texts(out / "train.texts.npy", text_offsets["train"]):
                yield texts
                tbar.update(len(texts))

    return Gathered(scanned, text_offsets, TrainingTexts(batches, fingerprint, chars))


def save_tokenizer(tok, tok_info: dict, out: Path) -> None:
    """The entry's own copy of the tokenizer, ``out/tokenizer.json``: the file it came from, else serialised."""
    tok_file = Path(tok_info.get("path") or "")
    if tok_file.is_file():
        shutil.copyfile(tok_file, out / "tokenizer.json")
    else:
        tok.save(str(out / "tokenizer.json"))  # the tokenizer cache could not be written: the entry still has its own


def build(cfg: RunConfig, out: Path) -> dict:
    """Prepare the configured data into the empty directory ``out`` (the files of a cache entry, ``meta.json`` last)
    and return the tokenizer facts (report.json ``data.tokenizer``: ``source`` trained / cache-hit / user, ``path``).

    Raises:
        UserError: bad input (the same messages, in the same order, as reading every row into memory).
        OSError: ``out`` cannot be written.
    """
    d = cfg.data
    g = gather(cfg, out)
    scan, text_offsets = g.scan, g.text_offsets
    tok, tok_info = load_or_train(g.training, d.vocab_size, d.cache_dir, d.tokenizer_path)
    tok.no_truncation()
    tok.no_padding()
    words = WordCacheEncoder.for_tokenizer(tok)
    splits: dict[str, dict] = {}
    with progress_bar(sum(map(len, scan.splits.values())), "tokenizing", cfg.train.progress, unit="row") as bar:
        for name in SPLITS:
            splits[name] = _encode_split(tok, out, name, text_offsets[name], d.max_len, bar.update, words)
    if words is not None and words.mismatch is not None:  # not expected: then every text is encoded directly
        print(f"warning: word-cache encoding differs from the tokenizer ({words.mismatch}); encoding every text "
              "directly instead (slower, exact)", file=sys.stderr, flush=True)
        for name in SPLITS:
            splits[name] = _encode_split(tok, out, name, text_offsets[name], d.max_len, lambda _n: None)
    save_tokenizer(tok, tok_info, out)
    meta = cache.meta_for(scan.name, scan.label_names, tok_info, tok.get_vocab_size(), pad_id(tok),
                          g.training.fingerprint, splits)
    meta["data_facts"] = {"blank_lines_skipped": scan.blank_lines, "first_blank_line": scan.first_blank_line}
    cache.write_meta(out, meta)
    return tok_info


def _encode_split(tok, out: Path, name: str, text_offsets: np.ndarray, max_len: int,
                  progress: Callable[[int], Optional[bool]], words: Optional[WordCacheEncoder] = None) -> dict:
    """Encode one split's texts chunk by chunk into ``<name>.ids.npy`` / ``<name>.offsets.npy``; its meta facts."""
    n = len(text_offsets) - 1
    offsets = np.zeros(n + 1, dtype=np.int64)
    truncated = unks = 0
    ids = NpyAppender(out / f"{name}.ids.npy", np.int32)
    row = 0
    try:
        for texts in read_texts(out / f"{name}.texts.npy", text_offsets):
            flat, lengths, cut, unk = encode_chunk(tok, texts, max_len, words)
            truncated, unks = truncated + cut, unks + unk
            ids.write(flat)
            offsets[row + 1:row + 1 + len(texts)] = offsets[row] + np.cumsum(lengths)
            row += len(texts)
            progress(len(texts))
            pause_point("data preparation")  # a test hook (no-op): a signal while the cache entry is written
    finally:
        ids.close()
    np.save(out / f"{name}.offsets.npy", offsets)
    return {"rows": n, "truncated": truncated, "unk_only_words": unks}

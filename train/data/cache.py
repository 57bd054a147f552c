"""Prepared data, computed once: the split, tokenized corpus cached on disk and memory-mapped back.

Parsing WordNet and encoding 117k texts takes seconds on every run; what they produce depends only on

* the source's **content** (SHA-256 of the WordNet ``data.*`` files or of the data file: one changed byte
  is another entry),
* the split and label settings (``val_fraction``, ``test_fraction``, ``max_samples``, the fields, ``num_classes``),
* the tokenizer: a user ``tokenizer.json``'s fingerprint, or the trained recipe (``FORMAT_VERSION`` and
  ``vocab_size``; training is deterministic, so the same texts give the same tokenizer),
* ``max_len``,
* for ``model.task=causal-lm`` also the task, the prompt/completion fields, the BOS/EOS/pad roles' files and the
  byte-level BPE recipe (train/data/causal_prepare.py); a classification entry's key does not change.

Those go into the key of ``<data.cache_dir>/data/<key>/``. An entry holds ``meta.json`` (names, counts,
fingerprints, the tokenizer facts), a copy of the tokenizer (``tokenizer.json``) and, per split, ``.npy`` arrays:
token ids (int32, flat) with row offsets (int64 ``[N+1]``), labels (int64), the texts as UTF-8 bytes with offsets.
Entries are read with ``numpy.load(mmap_mode="r")`` (no copy; rows are views into the mapping) and written to a
temporary directory that is renamed into place, so a reader never sees half an entry and two writers do not clash.
A temporary directory is named after its writer (``.<key>.<pid>-<pid namespace>@<host>.<random>``): the next
preparation removes those whose writer is dead (``kill -9``, a crash), and any older than an hour from another host
or an older version. Entries are built in bounded memory by train/data/prepare.py.

Hugging Face datasets (``hf:``) are not cached: there is no local file to fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

import train.data.wordnet as wordnet  # the module itself, not the package: no package <-> submodule import loop
from train.config import DataConfig
from train.data.sources import SPLITS, Corpus, TextSplit
from train.data.tokenizer import FORMAT_VERSION, TokenizedSplit, tokenizer_fingerprint
from train.errors import honour_umask, process_alive

CACHE_FORMAT = 1


class Ragged(Sequence):
    """Rows of a flat array: ``rows[i] = flat[offsets[i]:offsets[i + 1]]`` (a view, no copy).

    Args:
        flat: 1-D array of all rows back to back.
        offsets: int64 ``[N + 1]``, ``offsets[0] == 0``, ``offsets[N] == len(flat)``.
    """

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._row(i)

    def _row(self, i: int):
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


class Texts(Ragged):
    """Texts stored as UTF-8 bytes (uint8, flat) with byte offsets; ``texts[i]`` decodes one on access."""

    def _row(self, i: int) -> str:
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tobytes().decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        data, off = self.flat.tobytes(), self.offsets
        for k in range(len(self)):
            yield data[off[k]:off[k + 1]].decode("utf-8")


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


def _file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\x00")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def source_fingerprint(cfg: DataConfig) -> tuple[Optional[str], Optional[str]]:
    """(SHA-256 of the source's bytes, None), or (None, why it cannot be cached).

    Raises:
        UserError: the WordNet directory cannot be found (the same error the loader gives).
    """
    if cfg.source.startswith("hf:"):
        return None, "a Hugging Face dataset has no local file to fingerprint"
    if cfg.source == "wordnet":
        root = wordnet.find_wordnet_dir(cfg.wordnet_dir)
        files = [root / f"data.{pos}" for pos in wordnet.POS_FILES]
        return _file_sha256([f for f in files if f.is_file()]), None
    path = Path(cfg.source)
    if not path.is_file():
        return None, "no such file"  # the loader raises the user-facing error
    return _file_sha256([path]), None


def cache_key(cfg: DataConfig, source_sha: str, user_tokenizer_fp: Optional[str],
              task_parts: Optional[dict[str, Any]] = None) -> str:
    """The entry name: SHA-256 (first 20 hex) over everything the prepared data depends on (module docstring);
    ``task_parts``: what another task than classification adds or replaces (train/data/causal_prepare.py), so a
    classification entry keeps its key."""
    parts = {"format": CACHE_FORMAT, "source_sha256": source_sha, "source_kind": cfg.source if cfg.source == "wordnet"
             else Path(cfg.source).suffix.lower(), "text_field": cfg.text_field, "label_field": cfg.label_field,
             "num_classes": cfg.num_classes, "val_fraction": cfg.val_fraction, "test_fraction": cfg.test_fraction,
             "max_samples": cfg.max_samples, "max_len": cfg.max_len,
             "tokenizer": user_tokenizer_fp or f"wordpiece-v{FORMAT_VERSION}-{cfg.vocab_size}"}
    parts.update(task_parts or {})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Prepared:
    """The corpus, its tokenized splits and the tokenizer facts, fresh or from the cache.

    ``cache`` is report.json's ``data.cache`` (``hit``/``miss``/``off``) with ``cache_dir`` / ``cache_key`` or
    ``cache_unavailable_reason``.
    """

    corpus: Corpus
    splits: dict[str, TokenizedSplit]
    tokenizer_info: dict[str, Any]
    vocab_size: int
    pad_id: int
    data_fingerprint: str
    cache: dict[str, Any] = field(default_factory=dict)
    data_facts: dict[str, Any] = field(default_factory=dict)
    """Causal LM: what preparation dropped, cut or split (``meta.json`` ``data_facts``: train/data/data_policy.py)."""


STALE_AFTER_S = 3600.0
"""A temporary directory whose writer cannot be checked (another host, an older version) is removed after this long."""
ENTRY_TEMP = re.compile(r"\.[0-9a-f]{20}\.(?:(?P<pid>\d+)-(?P<ns>\d+)@(?P<host>.+)\.)?[a-z0-9_]{8}")
"""A temporary entry directory: ``.<key>.<writer>.<mkdtemp's 8 characters>`` (no writer: written before it was
named)."""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino  # two containers sharing a host name have their own pids
    except OSError:
        return 0


def writer_tag() -> str:
    """``<pid>-<pid namespace>@<host>``: who writes a temporary directory (:func:`remove_dead_writers`)."""
    return f"{os.getpid()}-{_pid_namespace()}@{socket.gethostname()}"


def writer_dir(parent: Path, prefix: str) -> Path:
    """A new temporary directory ``<prefix><writer tag>.<random>`` in ``parent`` (created), readable as the umask says.

    Raises:
        OSError: ``parent`` cannot be written.
    """
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{writer_tag()}.", dir=parent))
    honour_umask(tmp, directory=True)  # other users sharing the cache can read the entry
    return tmp


def _newest_mtime(d: Path) -> float:
    newest = d.stat().st_mtime
    for f in d.iterdir():
        try:
            newest = max(newest, f.stat().st_mtime)
        except OSError:
            pass
    return newest


def remove_dead_writers(parent: Path, pattern: re.Pattern = ENTRY_TEMP) -> list[Path]:
    """Remove the temporary directories in ``parent`` (names matching ``pattern``) that no live writer will finish:
    the writer's pid is gone (same host and pid namespace), or, where that cannot be checked, nothing in the directory
    changed for :data:`STALE_AFTER_S`. Returns what was removed; never raises."""
    removed: list[Path] = []
    host, ns = socket.gethostname(), _pid_namespace()
    try:
        children = list(parent.iterdir())
    except OSError:
        return removed
    for d in children:
        m = pattern.fullmatch(d.name)
        if m is None:
            continue
        try:
            if not d.is_dir():
                continue
            if m["pid"] is not None and m["host"] == host and int(m["ns"]) == ns:
                dead = int(m["pid"]) != os.getpid() and not process_alive(int(m["pid"]))
            else:
                dead = time.time() - _newest_mtime(d) > STALE_AFTER_S
        except OSError:
            continue
        if dead:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def publish(tmp: Path, entry: Path) -> None:
    """Rename the finished temporary directory ``tmp`` to ``entry`` (an entry another process wrote first is kept).

    Raises:
        OSError: the rename failed and there is no entry.
    """
    try:
        os.rename(tmp, entry)
    except OSError:
        if not (entry / "meta.json").is_file():  # not "another process wrote it first"
            raise


def meta_for(name: str, label_names: list[str], tokenizer_info: dict, vocab_size: int, pad_id: int,
             data_fingerprint: str, splits: dict[str, dict]) -> dict:
    """``meta.json`` of an entry; ``splits`` maps each split to ``{"rows", "truncated", "unk_only_words"}``."""
    return {"format": CACHE_FORMAT, "name": name, "label_names": label_names, "tokenizer_info": tokenizer_info,
            "vocab_size": vocab_size, "pad_id": pad_id, "data_fingerprint": data_fingerprint, "splits": splits}


def write_meta(tmp: Path, meta: dict) -> None:
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def save(entry: Path, p: Prepared) -> None:
    """Write the in-memory ``p`` as the entry ``entry`` (temporary directory, then rename; an existing entry is kept).
    Prepared data is normally written by train/data/prepare.py instead, chunk by chunk; this is the same format.

    Raises:
        OSError: the cache directory cannot be written.
    """
    tmp = writer_dir(entry.parent, f".{entry.name}.")
    try:
        splits = {}
        for name in SPLITS:
            split, texts = p.splits[name], p.corpus.split(name).texts
            encoded = [t.encode("utf-8") for t in texts]
            np.save(tmp / f"{name}.ids.npy", np.concatenate(list(split.ids)) if len(split) else np.zeros(0, np.int32))
            np.save(tmp / f"{name}.offsets.npy", _offsets([len(x) for x in split.ids]))
            np.save(tmp / f"{name}.labels.npy", np.asarray(split.labels, dtype=np.int64))
            np.save(tmp / f"{name}.texts.npy", np.frombuffer(b"".join(encoded), dtype=np.uint8))
            np.save(tmp / f"{name}.text_offsets.npy", _offsets([len(b) for b in encoded]))
            splits[name] = {"rows": len(split), "truncated": split.truncated, "unk_only_words": split.unk_only_words}
        tok_file = Path(p.tokenizer_info.get("path") or "")
        if tok_file.is_file():
            shutil.copyfile(tok_file, tmp / "tokenizer.json")
        write_meta(tmp, meta_for(p.corpus.name, p.corpus.label_names, p.tokenizer_info, p.vocab_size, p.pad_id,
                                 p.data_fingerprint, splits))
        publish(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(entry: Path) -> Optional[Prepared]:
    """The entry at ``entry`` memory-mapped, or None when it is missing, incomplete or of another format."""
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT:
            return None
        splits, texts = {}, {}
        for name in SPLITS:
            arr = {k: np.load(entry / f"{name}.{k}.npy", mmap_mode="r")
                   for k in ("ids", "offsets", "labels", "texts", "text_offsets")}
            if len(arr["offsets"]) != meta["splits"][name]["rows"] + 1:
                return None
            offsets = np.asarray(arr["offsets"])
            splits[name] = TokenizedSplit(ids=Ragged(arr["ids"], offsets), labels=np.asarray(arr["labels"]),
                                          lengths=np.diff(offsets).astype(np.int32),
                                          truncated=meta["splits"][name]["truncated"],
                                          unk_only_words=meta["splits"][name].get("unk_only_words"),
                                          dropped=meta["splits"][name].get("dropped", 0))
            texts[name] = TextSplit(Texts(arr["texts"], np.asarray(arr["text_offsets"])), splits[name].labels)
    except (OSError, ValueError, KeyError):
        return None
    corpus = Corpus(name=meta["name"], label_names=meta["label_names"], train=texts["train"],
                    validation=texts["validation"], test=texts["test"])
    tok_info = dict(meta["tokenizer_info"])
    if (entry / "tokenizer.json").is_file():  # the entry's own copy: valid even if the tokenizer cache was cleared
        tok_info["path"] = str(entry / "tokenizer.json")
    return Prepared(corpus=corpus, splits=splits, tokenizer_info=tok_info, vocab_size=meta["vocab_size"],
                    pad_id=meta["pad_id"], data_fingerprint=meta["data_fingerprint"],
                    data_facts=meta.get("data_facts", {}))


def user_tokenizer_fingerprint(path: Optional[str]) -> Optional[str]:
    """The fingerprint of a user ``tokenizer.json`` (None when none is configured or it cannot be read:
    the loader then raises the user-facing error)."""
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer

        return tokenizer_fingerprint(Tokenizer.from_file(str(path)))
    except Exception:  # tokenizers raises a generic Exception for a bad file
        return None

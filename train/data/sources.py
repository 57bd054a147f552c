"""Data sources behind one interface: built-in WordNet, JSONL/CSV/Parquet files, Hugging Face datasets.

Every source yields ``(key, text, raw_label, location)`` rows; :func:`load_corpus` validates them,
maps labels to ``int64`` class ids and splits train/validation/test by a stable hash of ``key``
(BLAKE2b, so the split is identical on every machine and Python version, unlike ``hash()``).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

import train.data.wordnet as wordnet  # the module itself, not the package: no package <-> submodule import loop
from train.config import DataConfig
from train.data.readers import Row, blank_note, hub_reachable, rows_for  # noqa: F401 (Row, hub_reachable re-exported)
from train.errors import UserError

SPLITS = ("train", "validation", "test")
SPARSE_SLACK = 64
"""Integer labels may leave up to max(distinct, SPARSE_SLACK) ids unused before they are refused as sparse."""


@dataclass
class TextSplit:
    """One split: ``texts[i]`` (str) with class id ``labels[i]`` (int64, shape [N])."""

    texts: list[str]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class Corpus:
    """A labelled text-classification corpus, already split."""

    name: str
    label_names: list[str]
    train: TextSplit
    validation: TextSplit
    test: TextSplit

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def split(self, name: str) -> TextSplit:
        return getattr(self, name)


def stable_fraction(key: str) -> float:
    """Map ``key`` to [0, 1) with BLAKE2b (stable across processes, machines and Python versions)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_of(key: str, val_fraction: float, test_fraction: float) -> str:
    """``train``/``validation``/``test`` for ``key``: test below ``test_fraction``, then validation, then train."""
    u = stable_fraction(key)
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"


class _Labels:
    """Raw labels collected row by row into compact form (an int64 per row, the distinct strings once), with the
    first row of each kind of problem, so :meth:`finish` gives exactly the class ids and the error a list of every raw
    label would give: ints must be in [0, num_classes); strings are sorted into ids."""

    def __init__(self) -> None:
        self.values = array("q")  # the int label, or the string label's code in ``codes``
        self.codes: dict[str, int] = {}
        self.first_int: Optional[int] = None
        self.first_str: Optional[int] = None
        self.bad: Optional[tuple[int, Any]] = None  # the first label that is neither int nor str, or a blank str
        self.wide: dict[int, int] = {}  # rows whose int label does not fit int64 (stored as -1: out of range)

    def add(self, x: Any) -> None:
        i = len(self.values)
        if isinstance(x, str):
            code = self.codes.get(x)
            if code is None:
                code = self.codes[x] = len(self.codes)
                if self.bad is None and not x.strip():
                    self.bad = (i, x)
            if self.first_str is None:
                self.first_str = i
            self.values.append(code)
        elif isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            if self.first_int is None:
                self.first_int = i
            try:
                self.values.append(x)
            except OverflowError:
                self.wide[i] = int(x)
                self.values.append(-1)
        else:
            if self.bad is None:
                self.bad = (i, x)
            self.values.append(0)

    def finish(self, cfg: DataConfig, names: Optional[list[str]],
               loc: Callable[[int], str]) -> tuple[np.ndarray, list[str]]:
        """Class ids (int64 [N]) and label names; ``loc(i)`` names row ``i`` in a message.

        Raises:
            UserError: a label of another type, an empty label, mixed kinds, sparse or out-of-range ints, more
                distinct strings than ``num_classes``.
        """
        raw = np.frombuffer(self.values, dtype=np.int64) if len(self.values) else np.zeros(0, np.int64)
        if self.first_str is None and self.bad is None:
            ids = raw.copy()
            distinct = np.unique(ids)
            top = int(ids.max())
            if cfg.num_classes is None and not names and top + 1 > max(2 * distinct.size, distinct.size + SPARSE_SLACK):
                shown = ", ".join(map(str, distinct[:5].tolist())) + (", …" if distinct.size > 5 else "")
                raise UserError(f"data: {distinct.size} distinct integer labels ({shown}) but the largest is {top}, "
                                f"so num_classes would be {top + 1}; remap the labels to 0..{distinct.size - 1} "
                                "(or use them as strings), or set data.num_classes")
            n = cfg.num_classes or (len(names) if names else top + 1)
            bad = np.flatnonzero((ids < 0) | (ids >= n))
            if bad.size:
                i = int(bad[0])
                raise UserError(f"{loc(i)}: label {self.wide.get(i, int(ids[i]))} is out of range [0, {n}); "
                                "fix the label or set data.num_classes")
            return ids, names[:n] if names else [str(k) for k in range(n)]
        if self.bad is not None:
            i, x = self.bad
            if isinstance(x, (list, tuple, np.ndarray)):  # a JSON list (or a Parquet list column)
                shown = list(x) if isinstance(x, np.ndarray) else x
                raise UserError(f"{loc(i)}: label {shown!r} is a list: multi-label rows are not supported (one label "
                                "per row); give each row one string or integer label, e.g. one row per label")
            if not isinstance(x, str):
                raise UserError(f"{loc(i)}: label {x!r} must be a string or an integer")
            raise UserError(f"{loc(i)}: empty label")
        if self.first_int is not None:
            i = self.first_int if self.first_int != 0 else self.first_str
            raise UserError(f"{loc(i)}: labels mix strings and integers; use one kind for every row")
        label_names = sorted(self.codes)
        if cfg.num_classes is not None and len(label_names) > cfg.num_classes:
            raise UserError(f"data has {len(label_names)} distinct labels but data.num_classes={cfg.num_classes}")
        index = {name: k for k, name in enumerate(label_names)}
        remap = np.asarray([index[name] for name in self.codes], dtype=np.int64)  # code order = first-seen order
        return remap[raw], label_names


def check_classes(splits: dict[str, np.ndarray], label_names: list[str], notice) -> list[str]:
    """Refuse fewer than 2 classes; name (with counts per split) the classes that have no training example.

    Returns the names of classes seen in validation/test but never in training (warned about via ``notice``).

    Raises:
        UserError: every example has the same label.
    """
    seen = np.unique(np.concatenate(list(splits.values())))
    if len(label_names) < 2:
        raise UserError(f"data: every example has the label {label_names[0]!r}; a classifier needs at least 2 classes "
                        "(add examples of other labels, or set data.num_classes for integer labels)")
    in_train = set(np.unique(splits["train"]).tolist())
    unseen = [int(k) for k in seen if int(k) not in in_train]
    if unseen:
        counts = "; ".join(f"{label_names[k]!r}: " + ", ".join(f"{s} {int((v == k).sum())}" for s, v in splits.items())
                           for k in unseen[:5])
        notice(f"warning: {len(unseen)} class(es) have no training example and cannot be learned ({counts}); "
               "they count as errors in evaluation (report.json data.classes_without_training_examples)",
               file=sys.stderr, flush=True)
    return [label_names[k] for k in unseen]


@dataclass
class Scan:
    """A source read once, kept compact: no Python object per row. Row ``i`` is the ``i``-th row the source yields.

    Attributes:
        name: the corpus name (``wordnet``, the file name, or the ``hf:`` spec).
        label_names: class names, by class id.
        labels: int64 ``[N]`` class ids, by row.
        splits: per split, the int64 row numbers in the split's order (by stable hash; ``max_samples`` applied).
        rows: rows read.
        blank_lines: blank lines a JSONL/CSV file skipped; first_blank_line: the first one (``file:line``) or None.
    """

    name: str
    label_names: list[str]
    labels: np.ndarray
    splits: dict[str, np.ndarray]
    rows: int
    blank_lines: int = 0
    first_blank_line: Optional[str] = None


def scan_source(cfg: DataConfig, on_text: Callable[[str], None],
                progress: Optional[Callable[[int], None]] = None) -> Scan:
    """Read, validate and split the configured source in one pass, handing each row's text to ``on_text`` (in row
    order) and keeping only its split hash (float64) and label (int64); ``progress(n)`` every 65,536 rows and at the
    end.

    Within each split, examples are ordered by their stable hash, so a ``max_samples`` cap takes a deterministic
    pseudo-random subset (not, say, only the nouns that come first in WordNet).

    Raises:
        UserError: missing source, malformed row (file:line), missing field, empty text, bad label,
            or an empty training split.
    """
    blank: list[str] = []
    name, rows = rows_for(cfg, blank.append)
    fractions = array("d")
    labels = _Labels()
    done = 0
    for key, text, label, loc in rows:
        if not isinstance(text, str):
            raise UserError(f"{loc}: text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise UserError(f"{loc}: empty text; remove the row or fill in {cfg.text_field!r}")
        if label is None:
            raise UserError(f"{loc}: missing label")
        fractions.append(stable_fraction(key))
        labels.add(label)
        on_text(text)
        if progress is not None and len(fractions) - done >= 65536:
            progress(len(fractions) - done)
            done = len(fractions)
    if progress is not None and len(fractions) > done:
        progress(len(fractions) - done)
    n = len(fractions)
    if not n:
        raise UserError(f"data.source={cfg.source!r}: no examples found")

    def loc_of(i: int) -> str:  # only for a message: read the source again up to row i
        for k, row in enumerate(rows_for(cfg, lambda _loc: None)[1]):
            if k == i:
                return row[3]
        return f"{name}: row {i}"

    ids, label_names = labels.finish(cfg, list(wordnet.LEXNAMES) if name == "wordnet" else None, loc_of)
    if blank:
        blank_note(Path(cfg.source), blank)  # the readers' own note, said once the scan has passed
    return Scan(name=name, label_names=label_names, labels=ids, splits=split_rows(fractions, cfg), rows=n,
                blank_lines=len(blank), first_blank_line=blank[0] if blank else None)


def split_rows(fractions: array, cfg: DataConfig) -> dict[str, np.ndarray]:
    """Per split, the int64 row numbers of the rows whose :func:`stable_fraction` are ``fractions`` (float64, by row),
    ordered by that hash, ``max_samples`` applied (:func:`split_of`'s rule, vectorized).

    Raises:
        UserError: the training split is empty.
    """
    u = np.frombuffer(fractions, dtype=np.float64)
    order = np.argsort(u, kind="stable")  # as sorted(): equal hashes (equal keys) keep their row order
    su = u[order]
    test, val = cfg.test_fraction, cfg.val_fraction
    splits = {"test": order[su < test], "validation": order[(su >= test) & (su < test + val)],
              "train": order[su >= test + val]}
    if cfg.max_samples is not None:
        tenth = max(1, cfg.max_samples // 10)
        caps = {"train": cfg.max_samples, "validation": tenth, "test": tenth}
        splits = {s: idx[: caps[s]] for s, idx in splits.items()}
    if not splits["train"].size:
        raise UserError(f"data.source={cfg.source!r}: the training split is empty ({len(u)} examples in all)")
    return {s: splits[s].astype(np.int64) for s in SPLITS}


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read, validate, split and (with ``cfg.max_samples``) subsample the configured source, every text in memory
    (:func:`scan_source`; the prepared-data path streams instead: train/data/prepare.py).

    Raises:
        UserError: as :func:`scan_source`.
    """
    texts: list[str] = []
    scan = scan_source(cfg, texts.append)

    def make(idx: np.ndarray) -> TextSplit:
        return TextSplit([texts[i] for i in idx.tolist()], scan.labels[idx])

    return Corpus(name=scan.name, label_names=scan.label_names, train=make(scan.splits["train"]),
                  validation=make(scan.splits["validation"]), test=make(scan.splits["test"]))

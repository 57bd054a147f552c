"""What a causal LM's data preparation leaves out, cuts or splits, by cause (``data.on_bad_row``, ``data.long_text``),
and the one line each outcome gets: a ``warning:`` for rows dropped, a note for texts cut or split, a refusal (exit 2)
for ``data.on_bad_row=error`` or when no row is left to train on.

Rows are numbered as the source yields them (``source row``: every row, kept or not), so a message can name the
first offending lines in file order, whatever split (hash) order they were met in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from train.data.tokenizer import TokenizedSplit
from train.errors import UserError

WHY = {
    "empty_text": "empty text",
    "empty_completion": "whitespace-only completion",
    "prompt_too_long": "prompt longer than data.max_len",
    "no_completion_fits": "no completion token fits after the prompt in data.max_len",
    "no_target": "no token to train on",
    "no_target_at_pack_len": "no completion token fits after the prompt in batching.pack_len",
    "no_assistant_turn": "a conversation without an assistant turn",
    "unknown_role": "a message role other than system, user and assistant",
}
"""Drop cause → what it says in a message (and ``report.json`` ``data.dropped_rows`` keys)."""
SHOWN = 3
"""Lines named per cause in the ``warning:`` line."""
LISTED = 10
"""Lines named in the ``data.on_bad_row=error`` refusal."""


@dataclass
class DropLog:
    """Rows left out while preparing, by cause: counts, and enough rows to name the first ones in file order.

    ``early`` holds ``(source row, cause, location)`` of rows dropped while reading (their location is known then);
    ``late`` per cause the scan-row numbers (int, rows read and kept, in the scan's numbering) of rows dropped at
    tokenization, resolved into locations by a second read (:meth:`first`)."""

    counts: dict[str, int] = field(default_factory=dict)
    early: list[tuple[int, str, str]] = field(default_factory=list)
    late: dict[str, list[int]] = field(default_factory=dict)
    blank_lines: int = 0
    first_blank: Optional[str] = None

    def read_drop(self, source_row: int, cause: str, loc: str) -> None:
        self.counts[cause] = self.counts.get(cause, 0) + 1
        if self.counts[cause] <= LISTED:
            self.early.append((source_row, cause, loc))

    def token_drop(self, scan_row: int, cause: str) -> None:
        self.counts[cause] = self.counts.get(cause, 0) + 1
        self.late.setdefault(cause, []).append(scan_row)

    def blank(self, loc: str) -> None:
        self.blank_lines += 1
        self.first_blank = self.first_blank or loc

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def first(self, locate: Callable[[set[int]], dict[int, tuple[int, str]]]) -> list[tuple[int, str, str]]:
        """The first :data:`LISTED` dropped rows of each cause, ``(source row, cause, location)`` in file order;
        ``locate(scan rows)`` maps scan rows to ``(source row, location)`` (one read of the source)."""
        wanted = {cause: sorted(rows)[:LISTED] for cause, rows in self.late.items()}
        where = locate({r for rows in wanted.values() for r in rows}) if wanted else {}
        late = [(*where[r], cause) for cause, rows in wanted.items() for r in rows if r in where]
        return sorted(self.early + [(src, cause, loc) for src, loc, cause in late])


def _detail(cause: str, max_len: int, pack_len: Optional[int]) -> str:
    text = WHY[cause].replace("data.max_len", f"data.max_len={max_len}")
    return text.replace("batching.pack_len", f"batching.pack_len={pack_len}")


def facts(log: DropLog, first: list[tuple[int, str, str]]) -> dict:
    """``meta.json`` / ``report.json`` facts of ``log``: ``dropped_rows`` {cause: count}, ``dropped_rows_first``
    {cause: [location, …]} (the first :data:`SHOWN`, file order), ``blank_lines_skipped`` and the first one."""
    shown: dict[str, list[str]] = {}
    for _src, cause, loc in first:
        if len(shown.setdefault(cause, [])) < SHOWN:
            shown[cause].append(loc)
    return {"dropped_rows": dict(sorted(log.counts.items())), "dropped_rows_first": shown,
            "blank_lines_skipped": log.blank_lines, "first_blank_line": log.first_blank}


def drop_line(f: dict, max_len: int, pack_len: Optional[int] = None) -> Optional[str]:
    """The one ``warning:`` line for the rows dropped (``f``: :func:`facts`), or None when none was; blank lines
    skipped are said in it too."""
    counts, shown = f.get("dropped_rows", {}), f.get("dropped_rows_first", {})
    parts = [f"{n} {_detail(cause, max_len, pack_len)}" + _lines(shown.get(cause, []), n)
             for cause, n in counts.items() if n]
    blank = f.get("blank_lines_skipped", 0)
    if not parts and not blank:
        return None
    said = f"{_n(blank, 'blank line')} skipped (first: {f.get('first_blank_line')})"
    if not parts:
        return f"note: {said}"
    line = (f"warning: {_n(sum(counts.values()), 'row')} dropped, nothing to learn from them: " + "; ".join(parts)
            + "; fix them, or set data.on_bad_row=error to refuse such data (report.json data.dropped_rows)")
    return line + (f"; {said}" if blank else "")


def _n(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def _lines(locs: list[str], n: int) -> str:
    return f" ({', '.join(locs)}{', …' if n > len(locs) else ''})" if locs else ""


def refusal(first: list[tuple[int, str, str]], total: int, max_len: int) -> UserError:
    """``data.on_bad_row=error``: every offending row at once, the first :data:`LISTED` in file order and the total."""
    listed = "; ".join(f"{loc}: {_detail(cause, max_len, None)}" for _src, cause, loc in first[:LISTED])
    more = f" (the first {LISTED} of {total})" if total > LISTED else ""
    return UserError(f"{total} row{'s' if total != 1 else ''} a model cannot learn from{more}: {listed}; fix them, "
                     "or set data.on_bad_row=drop to leave them out (counted)")


def nothing_left(counts: dict[str, int], where: str, max_len: int, pack_len: Optional[int] = None,
                 first: Sequence[tuple[int, str, str]] = ()) -> UserError:
    """No training sample has a trained target: how many rows were dropped, and why (``first``: the first dropped
    rows, ``(source row, cause, location)``, named)."""
    why = "; ".join(f"{n} {_detail(cause, max_len, pack_len)}" for cause, n in sorted(counts.items()) if n)
    why += f"; first: {', '.join(loc for _src, _cause, loc in first[:SHOWN])}" if first else ""
    fix = ("raise batching.pack_len (or null: data.max_len)" if "no_target_at_pack_len" in counts
           else "raise data.max_len, shorten the prompts or fix the rows")
    return UserError(f"{where}: no training row is left with a target to train on (dropped: {why}); {fix}")


def long_text_line(policy: str, truncated: int, cut_tokens: int, split_texts: int, chunks: int,
                   max_len: int) -> Optional[str]:
    """The one console line saying what ``data.long_text`` did (None when no sample was longer than ``max_len``)."""
    if not truncated and not split_texts:
        return None
    cut = (f"{_n(truncated, 'sample')} longer than data.max_len={max_len} cut to it, {cut_tokens:,} tokens dropped"
           if truncated else "")
    if policy == "split":
        made = f"{_n(split_texts, 'text')} longer than data.max_len={max_len} split into {chunks:,} samples"
        return f"note: data.long_text=split: {made}" + (f"; {cut} (prompt + completion rows)" if cut else "")
    return f"note: data.long_text=truncate: {cut}; data.long_text=split keeps every token (texts as max_len chunks)"


class Picked(Sequence):
    """``rows[k] = base[index[k]]``: a subset of a split's rows, no copy (``index`` int64)."""

    def __init__(self, base: Sequence, index: np.ndarray) -> None:
        self.base, self.index = base, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self.base[int(i)] for i in self.index[k]]
        return self.base[int(self.index[k])]


def untrainable_at(split: TokenizedSplit, capacity: int) -> np.ndarray:
    """bool ``[N]``: the samples that have no trained target once cut to ``capacity`` tokens (a packed row): longer
    than it, their prompt fills it (train/data/causal_collate.py ``fit_sample``)."""
    return (np.asarray(split.lengths) > capacity) & (np.asarray(split.labels) >= capacity - 1)


def without(split: TokenizedSplit, drop: np.ndarray) -> TokenizedSplit:
    """``split`` without the rows where ``drop`` (bool ``[N]``), counted in its ``dropped``."""
    keep = np.flatnonzero(~drop)
    return TokenizedSplit(ids=Picked(split.ids, keep), labels=np.asarray(split.labels)[keep],
                          lengths=np.asarray(split.lengths)[keep], truncated=split.truncated,
                          unk_only_words=split.unk_only_words, dropped=split.dropped + int(drop.sum()))

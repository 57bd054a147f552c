"""Dataset wrapper and collate: pad each batch to its bucket bound (static shapes) with a bool mask."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from train.data.tokenizer import TokenizedSplit

IGNORE_LABEL = -100
"""The label of a filler row (``F.cross_entropy``'s default ``ignore_index``); metrics skip it."""


class TokenDataset(Dataset):
    """``dataset[i] -> (ids int32 [L_i], label int)`` over a :class:`TokenizedSplit`."""

    def __init__(self, split: TokenizedSplit) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.split.ids[i], int(self.split.labels[i])


class PadCollate:
    """Collate ``[(ids, label), …]`` into a padded batch.

    Padding target S:
      * ``bounds`` given, ``pad_to="bound"``: the smallest bound ≥ the longest sample (static shapes);
      * ``pad_to="batch-max"``: the longest sample in the batch (dynamic shapes).
    A sample longer than the largest bound is cut to it, keeping its final ([SEP]) token;
    ``batch["truncated"]`` counts those.

    ``rows`` (evaluation, ``pad_to="bound"`` only): per bound (aligned with ``bounds``), the batch sizes a batch
    may have; a batch is filled up to the smallest of them that holds it with copies of its first sample labelled
    :data:`IGNORE_LABEL` (evaluation passes the training batch size: no shapes of its own for partial batches).
    Filler rows add no real tokens and no samples.

    Returns a dict: ``input_ids`` LongTensor[B, S], ``attention_mask`` BoolTensor[B, S] (True = real
    token), ``labels`` LongTensor[B] (:data:`IGNORE_LABEL` on filler rows), ``samples`` int (real rows),
    ``real_tokens`` int, ``truncated`` int.
    Picklable, so it works with ``num_workers > 0``; allocates fresh tensors per batch and keeps no
    state between batches (host memory stays flat across epochs).
    """

    def __init__(self, pad_id: int, bounds: Optional[Sequence[int]] = None, pad_to: str = "bound",
                 rows: Optional[Sequence[Sequence[int]]] = None) -> None:
        if pad_to not in ("bound", "batch-max"):
            raise ValueError("pad_to must be 'bound' or 'batch-max'")
        if pad_to == "bound" and not bounds:
            raise ValueError("pad_to='bound' needs bounds")
        if rows is not None and (pad_to != "bound" or len(rows) != len(bounds or ())):
            raise ValueError("rows needs pad_to='bound' and one batch size per bound")
        self.pad_id = pad_id
        self.bounds = sorted(int(b) for b in bounds) if bounds else None
        self.pad_to = pad_to
        self.rows = {b: sorted(int(x) for x in r) for b, r in zip(self.bounds, rows)} if rows is not None else None

    def target_shape(self, n: int, longest: int) -> tuple[int, int]:
        """(B, S) of the padded batch of ``n`` samples whose longest has ``longest`` tokens."""
        s = self.target_length(longest)
        if not self.rows:
            return n, s
        return next((r for r in self.rows[s] if r >= n), n), s

    def target_length(self, longest: int) -> int:
        if self.pad_to == "batch-max":
            return longest if self.bounds is None else min(longest, self.bounds[-1])
        k = bisect.bisect_left(self.bounds, longest)
        return self.bounds[min(k, len(self.bounds) - 1)]

    def __call__(self, batch: list[tuple[np.ndarray, int]]) -> dict:
        n = len(batch)
        rows, s = self.target_shape(n, max(len(ids) for ids, _ in batch))
        input_ids = torch.full((rows, s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, s), dtype=torch.bool)
        truncated = 0
        for row, (ids, _) in enumerate(batch):
            if len(ids) > s:
                ids = np.concatenate([ids[: s - 1], ids[-1:]])
                truncated += 1
            input_ids[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            mask[row, : len(ids)] = True
        real_tokens = int(mask.sum())
        labels = torch.tensor([label for _, label in batch] + [IGNORE_LABEL] * (rows - n), dtype=torch.long)
        if rows > n:  # filler rows: the first sample again (a real, finite forward), ignored by loss and metrics
            input_ids[n:], mask[n:] = input_ids[0], mask[0]
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "samples": n,
                "real_tokens": real_tokens, "truncated": truncated}

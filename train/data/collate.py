"""Dataset wrapper and collate: pad each batch to its bucket bound (static shapes) with a bool mask."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from train.data.tokenizer import TokenizedSplit


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

    Returns a dict: ``input_ids`` LongTensor[B, S], ``attention_mask`` BoolTensor[B, S] (True = real
    token), ``labels`` LongTensor[B], ``real_tokens`` int, ``truncated`` int.
    Picklable, so it works with ``num_workers > 0``; allocates fresh tensors per batch and keeps no
    state between batches (host memory stays flat across epochs).
    """

    def __init__(self, pad_id: int, bounds: Optional[Sequence[int]] = None, pad_to: str = "bound") -> None:
        if pad_to not in ("bound", "batch-max"):
            raise ValueError("pad_to must be 'bound' or 'batch-max'")
        if pad_to == "bound" and not bounds:
            raise ValueError("pad_to='bound' needs bounds")
        self.pad_id = pad_id
        self.bounds = sorted(int(b) for b in bounds) if bounds else None
        self.pad_to = pad_to

    def target_length(self, longest: int) -> int:
        if self.pad_to == "batch-max":
            return longest if self.bounds is None else min(longest, self.bounds[-1])
        k = bisect.bisect_left(self.bounds, longest)
        return self.bounds[min(k, len(self.bounds) - 1)]

    def __call__(self, batch: list[tuple[np.ndarray, int]]) -> dict:
        s = self.target_length(max(len(ids) for ids, _ in batch))
        input_ids = torch.full((len(batch), s), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), s), dtype=torch.bool)
        truncated = 0
        for row, (ids, _) in enumerate(batch):
            if len(ids) > s:
                ids = np.concatenate([ids[: s - 1], ids[-1:]])
                truncated += 1
            input_ids[row, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            mask[row, : len(ids)] = True
        labels = torch.tensor([label for _, label in batch], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
                "real_tokens": int(mask.sum()), "truncated": truncated}

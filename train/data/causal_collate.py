"""Causal-LM batches (docs/models.md, "The causal-LM contract"), padded to a bucket bound or packed in rows, from
samples
``(ids, n_prompt)`` (train/data/causal_prepare.py), and the task-aware choice of collate (:func:`pad_collate_for`,
:func:`pack_collate_for`): classification keeps :class:`~train.data.collate.PadCollate` /
:class:`~train.data.packing.PackCollate` as they are.

The targets are built here, already shifted: ``labels[t] = ids[t + 1]`` where position ``t`` is trained
(``t + 1 >= max(n_prompt, 1)`` and ``t + 1 < len(ids)``), else :data:`IGNORE_INDEX` (:func:`causal_targets`). So a
sample's last position (its EOS) has no target and no target crosses into the next sample of a packed row; padding
(the pad id, EOS's for a tokenizer without a pad token) is never a target: masked by position, never by id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from train.data.collate import IGNORE_LABEL, PadCollate
from train.data.packing import PackCollate

IGNORE_INDEX = IGNORE_LABEL
"""A position with no target (``F.cross_entropy``'s default ``ignore_index``, -100)."""
CAUSAL_LM = "causal-lm"


def causal_targets(ids: np.ndarray, n_prompt: int) -> np.ndarray:
    """int64 ``[len(ids)]``: ``ids[t + 1]`` where position ``t`` is trained, else :data:`IGNORE_INDEX`."""
    out = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    start = max(int(n_prompt), 1) - 1
    if start < len(ids) - 1:
        out[start:len(ids) - 1] = ids[start + 1:]
    return out


def fit_sample(ids: np.ndarray, n_prompt: int, room: int) -> tuple[np.ndarray, int, bool]:
    """``(ids, n_prompt, cut)``: a sample longer than ``room`` cut to ``ids[:room - 1] + ids[-1:]`` (EOS kept); when
    no completion token is left after the prompt, nothing of it is trained (``n_prompt`` = its new length)."""
    if len(ids) <= room:
        return ids, n_prompt, False
    ids = np.concatenate([ids[:room - 1], ids[-1:]])
    return ids, (room if n_prompt >= room - 1 else n_prompt), True


class CausalPadCollate(PadCollate):
    """Collate ``[(ids, n_prompt), …]`` into a padded causal-LM batch (the shapes, truncation and evaluation filler
    rows of :class:`~train.data.collate.PadCollate`; filler rows have no targets).

    Returns a dict: ``input_ids`` LongTensor[B, S] (the pad id after each sample), ``attention_mask`` BoolTensor[B, S]
    (True = real token), ``labels`` LongTensor[B, S] (the shifted targets, :data:`IGNORE_INDEX` elsewhere),
    ``samples`` int (real rows), ``real_tokens`` int, ``target_tokens`` int (labels that are trained), ``truncated``
    int."""

    def __call__(self, batch: list[tuple[np.ndarray, int]]) -> dict:
        n = len(batch)
        rows, s = self.target_shape(n, max(len(ids) for ids, _ in batch))
        input_ids = np.full((rows, s), self.pad_id, dtype=np.int64)
        labels = np.full((rows, s), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((rows, s), dtype=bool)
        truncated = 0
        for row, (ids, n_prompt) in enumerate(batch):
            ids, n_prompt, cut = fit_sample(ids, int(n_prompt), s)
            truncated += cut
            input_ids[row, :len(ids)] = ids
            labels[row, :len(ids)] = causal_targets(ids, n_prompt)
            mask[row, :len(ids)] = True
        real_tokens = int(mask.sum())
        if rows > n:  # filler rows: the first sample again (a real, finite forward), nothing trained
            input_ids[n:], mask[n:] = input_ids[0], mask[0]
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels), "samples": n, "real_tokens": real_tokens,
                "target_tokens": int((labels != IGNORE_INDEX).sum()), "truncated": truncated}


class CausalPackCollate(PackCollate):
    """Collate rows of samples ``[[(ids, n_prompt), …], …]`` into one packed causal-LM batch of shape [R, C] (rows,
    ``static_rows`` and truncation as :class:`~train.data.packing.PackCollate`).

    Returns a dict: ``input_ids``, ``position_ids`` (restarting at 0 per sample), ``seq_index`` (the sample's number
    in the batch, -1 on padding), ``labels`` (the shifted targets of each sample, its last position
    :data:`IGNORE_INDEX`: no target crosses into the next sample) LongTensor[R, C]; ``attention_mask``
    BoolTensor[R, C]; ``samples``, ``num_seqs`` (``max_seqs`` when given: a static number of sample slots, else
    ``samples``), ``real_tokens``, ``target_tokens``, ``truncated`` ints."""

    def __call__(self, rows: list[list[tuple[np.ndarray, int]]]) -> dict:
        if len(rows) > self.rows:
            raise ValueError(f"{len(rows)} rows in a batch of {self.rows}")
        c, n_rows = self.capacity, self.rows if self.static_rows else max(1, len(rows))
        ids = np.full((n_rows, c), self.pad_id, dtype=np.int64)
        pos = np.zeros((n_rows, c), dtype=np.int64)
        seq = np.full((n_rows, c), -1, dtype=np.int64)
        labels = np.full((n_rows, c), IGNORE_INDEX, dtype=np.int64)
        samples = truncated = 0
        for r, row in enumerate(rows):
            at = 0
            for sample_ids, n_prompt in row:
                sample_ids, n_prompt, cut = fit_sample(sample_ids, int(n_prompt), c)
                truncated += cut
                n = len(sample_ids)
                if at + n > c:
                    raise ValueError(f"row {r} holds more than {c} tokens")
                ids[r, at:at + n] = sample_ids
                pos[r, at:at + n] = np.arange(n)
                seq[r, at:at + n] = samples
                labels[r, at:at + n] = causal_targets(sample_ids, n_prompt)
                samples, at = samples + 1, at + n
        if self.max_seqs is not None and samples > self.max_seqs:
            raise ValueError(f"{samples} samples in a packed batch of at most {self.max_seqs}")
        mask = seq >= 0
        return {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos),
                "seq_index": torch.from_numpy(seq), "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels), "samples": samples,
                "num_seqs": self.max_seqs if self.max_seqs is not None else samples, "real_tokens": int(mask.sum()),
                "target_tokens": int((labels != IGNORE_INDEX).sum()), "truncated": truncated}


def pad_collate_for(task: str, pad_id: int, bounds: Optional[Sequence[int]] = None, pad_to: str = "bound",
                    rows: Optional[Sequence[Sequence[int]]] = None) -> PadCollate:
    """The padded-batch collate of ``task`` (``model.task``): :class:`CausalPadCollate` for ``causal-lm``, else
    :class:`~train.data.collate.PadCollate` (classification, unchanged)."""
    cls = CausalPadCollate if task == CAUSAL_LM else PadCollate
    return cls(pad_id, bounds, pad_to, rows)


def pack_collate_for(task: str, pad_id: int, capacity: int, rows_per_batch: int, max_seqs: Optional[int] = None,
                     static_rows: bool = True) -> PackCollate:
    """The packed-batch collate of ``task``: :class:`CausalPackCollate` for ``causal-lm``, else
    :class:`~train.data.packing.PackCollate` (classification, unchanged)."""
    cls = CausalPackCollate if task == CAUSAL_LM else PackCollate
    return cls(pad_id, capacity, rows_per_batch, max_seqs, static_rows)

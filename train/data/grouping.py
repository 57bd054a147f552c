"""Hugging Face's ``group_by_length`` batching, re-implemented as a baseline (no transformers dependency).

Source: ``transformers/trainer_pt_utils.py``, ``get_length_grouped_indices`` (used by
``LengthGroupedSampler`` when ``TrainingArguments(group_by_length=True)``): the indices are
randomly permuted, cut into megabatches of ``mega_batch_mult × batch_size`` (default
``min(N // (4 · batch_size), 50)``, at least 1), each megabatch is sorted by length, longest
first, and the longest sample of all is swapped to the very front (an OOM shows up at step 1).
The Trainer then cuts that index list into consecutive batches of ``batch_size`` and its
collator pads each batch to the batch maximum (dynamic shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.utils.data


def length_grouped_indices(lengths: Sequence[int], batch_size: int, mega_batch_mult: Optional[int] = None,
                           generator: Optional[torch.Generator] = None) -> list[int]:
    """A permutation of ``range(len(lengths))`` where each ``batch_size`` slice holds similar lengths.

    Same algorithm and same random draws (``torch.randperm`` with ``generator``) as
    ``transformers.trainer_pt_utils.get_length_grouped_indices``.

    Raises:
        ValueError: ``batch_size`` or ``mega_batch_mult`` < 1.
    """
    if batch_size < 1 or (mega_batch_mult is not None and mega_batch_mult < 1):
        raise ValueError("batch_size and mega_batch_mult must be ≥ 1")
    n = len(lengths)
    if n == 0:
        return []
    if mega_batch_mult is None:
        mega_batch_mult = max(1, min(n // (batch_size * 4), 50))
    indices = torch.randperm(n, generator=generator)
    size = mega_batch_mult * batch_size
    megabatches = [sorted(indices[i : i + size].tolist(), key=lambda j: lengths[j], reverse=True)
                   for i in range(0, n, size)]
    maxima = [lengths[mb[0]] for mb in megabatches]
    top = max(range(len(maxima)), key=lambda i: maxima[i])  # first occurrence, like torch.argmax
    megabatches[0][0], megabatches[top][0] = megabatches[top][0], megabatches[0][0]
    return [i for mb in megabatches for i in mb]


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int = 0, epoch: int = 0,
                           mega_batch_mult: Optional[int] = None) -> list[list[int]]:
    """The batches the HF Trainer would form for one epoch: consecutive ``batch_size`` slices of
    :func:`length_grouped_indices`, seeded like ``DistributedLengthGroupedSampler`` (``seed + epoch``).
    The last batch may be smaller (``dataloader_drop_last=False``)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = length_grouped_indices(lengths, batch_size, mega_batch_mult, g)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """The HF Trainer's batches (:func:`length_grouped_batches`) as a batch sampler for
    ``batching.method=hf-group-by-length``.

    Seeded per (seed, epoch) through :meth:`set_epoch`. Not rank-aware: a single-process baseline.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, drop_last: bool = False) -> None:
        self.lengths = list(lengths)
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.epoch = 0
        self.dropped_samples = len(self.lengths) % batch_size if drop_last else 0
        self.repeated_samples = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for batch in length_grouped_batches(self.lengths, self.batch_size, self.seed, self.epoch):
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

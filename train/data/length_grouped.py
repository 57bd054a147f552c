"""Hugging Face's ``group_by_length`` batching, as a baseline to measure bucketing against.

Re-implements ``transformers.trainer_pt_utils.get_length_grouped_indices`` (used by
``LengthGroupedSampler`` when ``TrainingArguments.group_by_length=True``): a random permutation
is cut into megabatches of ``mega_batch_mult × batch_size`` samples (mult = min(N // (4·B), 50)),
each megabatch is sorted by length, longest first, the longest megabatch leads, and consecutive
runs of ``batch_size`` indices form the batches, which are padded to the batch max (so the run
sees many distinct sequence lengths). Not rank-aware: a baseline for single-process benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler


def length_grouped_indices(lengths: Sequence[int], batch_size: int, rng: np.random.Generator,
                           mega_batch_mult: int | None = None) -> list[int]:
    """The HF ordering of ``range(len(lengths))`` (see the module docstring)."""
    n = len(lengths)
    if mega_batch_mult is None:
        mega_batch_mult = max(1, min(n // (batch_size * 4), 50))
    indices = rng.permutation(n)
    size = mega_batch_mult * batch_size
    megabatches = [sorted(indices[i : i + size].tolist(), key=lambda j: lengths[j], reverse=True) for i in range(0, n, size)]
    longest = int(np.argmax([lengths[m[0]] for m in megabatches]))
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [i for m in megabatches for i in m]


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` consecutive indices of :func:`length_grouped_indices`; seeded per (seed, epoch)."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, drop_last: bool = False) -> None:
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.epoch = 0
        self.dropped_samples = len(self.lengths) % batch_size if drop_last else 0
        self.repeated_samples = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = length_grouped_indices(self.lengths, self.batch_size, np.random.default_rng([self.seed, self.epoch]))
        for i in range(0, len(order), self.batch_size):
            batch = order[i : i + self.batch_size]
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

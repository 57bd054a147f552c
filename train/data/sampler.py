"""``BucketBatchSampler``: length-bucketed batches, seeded, exactly-once, rank-aware, resumable.

Each sample goes to the smallest bucket whose bound ≥ its length. Within a bucket, samples are
shuffled and cut into batches of ``batch_size`` samples, or — with a token budget ``max_tokens``
(fairseq's ``--max-tokens``) — of ⌊max_tokens / bound⌋ samples. Batch order is shuffled too. The
permutation depends only on (seed, epoch), so every rank computes the same global plan and takes
its own slice.

Accounting per epoch: with ``drop_last`` each bucket's incomplete last batch is dropped
(``dropped_samples``); under DDP the batch count is rounded to a multiple of ``world_size`` —
down with ``drop_last`` (more drops), up without it by repeating batches from the start of the
plan (``repeated_samples``), so every rank runs the same number of steps and nothing is lost.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
from torch.utils.data import Sampler

from train.data.buckets import assign_buckets


class BucketBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices.

    Args:
        lengths: int [N] token length of each sample.
        bounds: sorted bucket upper bounds; one bound ≥ max(lengths) gives plain random batching.
        batch_size: samples per batch (used when ``max_tokens`` is None).
        max_tokens: token budget per padded batch: bucket k gets max(1, ⌊max_tokens / bounds[k]⌋) samples.
        round_batch_to: round token-budget batch sizes down to a multiple of this (≥ 1 sample kept).
        shuffle: shuffle within buckets and the batch order (False: sorted by bucket, then index).
        seed, drop_last, world_size, rank: as in ``DistributedSampler``.

    Raises:
        ValueError: invalid sizes or rank.
    """

    def __init__(self, lengths: Sequence[int], bounds: Sequence[int], batch_size: int = 32,
                 max_tokens: Optional[int] = None, round_batch_to: int = 1, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, world_size: int = 1, rank: int = 0) -> None:
        if batch_size < 1 or (max_tokens is not None and max_tokens < 1) or round_batch_to < 1:
            raise ValueError("batch_size, max_tokens and round_batch_to must be ≥ 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.bounds = [int(b) for b in bounds]
        self.bucket_of = assign_buckets(self.lengths, self.bounds)
        self.batch_sizes = [self._size(b, batch_size, max_tokens, round_batch_to) for b in self.bounds]
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.world_size, self.rank = world_size, rank
        self.epoch = 0
        self._start = 0  # batches of this epoch already consumed (for resume)
        self.dropped_samples = 0
        self.repeated_samples = 0
        self.epoch_counts: dict[int, tuple[int, int]] = {}  # epoch → (dropped, repeated), each epoch planned

    @staticmethod
    def _size(bound: int, batch_size: int, max_tokens: Optional[int], round_to: int) -> int:
        if max_tokens is None:
            return batch_size
        n = max_tokens // bound
        if round_to > 1 and n >= round_to:
            n -= n % round_to
        return max(1, n)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation (call before iterating, as with DistributedSampler)."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def _global_plan(self) -> list[list[int]]:
        """All ranks' batches for this epoch, in order; also updates the drop/repeat counters."""
        rng = np.random.default_rng([self.seed, self.epoch])
        batches: list[list[int]] = []
        dropped = 0
        for k, size in enumerate(self.batch_sizes):
            members = np.flatnonzero(self.bucket_of == k)
            if self.shuffle:
                members = rng.permutation(members)
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                if len(chunk) < size and self.drop_last:
                    dropped += len(chunk)
                    continue
                batches.append(chunk.tolist())
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        repeated = 0
        w = self.world_size
        if len(batches) % w:
            if self.drop_last or not batches:
                keep = len(batches) - len(batches) % w
                dropped += sum(len(b) for b in batches[keep:])
                batches = batches[:keep]
            else:
                extra = [batches[i % len(batches)] for i in range(w - len(batches) % w)]
                repeated = sum(len(b) for b in extra)
                batches += extra
        self.dropped_samples, self.repeated_samples = dropped, repeated
        self.epoch_counts[self.epoch] = (dropped, repeated)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        mine = self._global_plan()[self.rank :: self.world_size]
        start = self._start
        for i in range(start, len(mine)):
            self._start = i + 1
            yield mine[i]
        self._start = 0  # a finished epoch resumes at the start of the next one

    def __len__(self) -> int:
        total = 0
        for k, size in enumerate(self.batch_sizes):
            n = int(np.count_nonzero(self.bucket_of == k))
            total += n // size if self.drop_last else math.ceil(n / size)
        w = self.world_size
        total = total // w * w if self.drop_last else math.ceil(total / w) * w
        return total // w

    def state_dict(self) -> dict:
        """Plain ints only (safe for ``torch.load(weights_only=True)``)."""
        return {"epoch": self.epoch, "start": self._start, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``__iter__`` yields exactly the batches not yet consumed in ``state['epoch']``."""
        self.epoch, self._start, self.seed = int(state["epoch"]), int(state["start"]), int(state["seed"])


class ShardedBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s share of ``inner``'s batches for evaluation: batches rank, rank + w, rank + 2w, …

    Nothing is repeated or dropped, so the union over ranks is every sample exactly once and
    reduced metrics equal the single-process ones; ranks may get one batch fewer than others,
    which is fine for evaluation (no collective inside its loop).
    """

    def __init__(self, inner: BucketBatchSampler, world_size: int, rank: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.inner, self.world_size, self.rank = inner, world_size, rank

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.inner):
            if i % self.world_size == self.rank:
                yield batch

    def __len__(self) -> int:
        return len(range(self.rank, len(self.inner), self.world_size))


def run_counts(sampler, epochs: int) -> dict[str, int]:
    """``dropped`` and ``repeated`` samples summed over epochs ``0 … epochs - 1`` of a training batch sampler (each
    epoch's plan has its own counts). Epochs this process did not plan (before a resume) are planned on a copy."""
    if not hasattr(sampler, "epoch_counts"):  # a sampler whose counts are the same every epoch
        return {"dropped": sampler.dropped_samples * epochs, "repeated": sampler.repeated_samples * epochs}
    for epoch in range(epochs):
        if epoch not in sampler.epoch_counts:
            probe = copy.copy(sampler)  # shares epoch_counts: planning the copy records its counts
            probe.epoch, probe._plan = epoch, (-1, [])
            probe._global_plan()
    counts = [sampler.epoch_counts[e] for e in range(epochs)]
    return {"dropped": sum(c[0] for c in counts), "repeated": sum(c[1] for c in counts)}

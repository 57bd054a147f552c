"""DataLoaders over a :class:`~train.data.bundle.DataBundle`'s splits: bucketed (padded to the bucket bound or the
batch maximum), Hugging Face's length grouping, or packed rows (:class:`PackLayout`), rank-aware under DDP."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from train.config import RunConfig
from train.data.bundle import DataBundle
from train.data.causal_collate import pack_collate_for, pad_collate_for
from train.data.collate import TokenDataset
from train.data.grouping import LengthGroupedBatchSampler
from train.data.packing import PackedBatchSampler, RowDataset
from train.data.sampler import BucketBatchSampler, ShardedBatchSampler
from train.errors import UserError


@dataclass(frozen=True)
class PackLayout:
    """``batching.method=packed``: ``capacity`` tokens per row, ``rows`` rows per step, ``max_seqs`` label slots per
    step (rows × capacity // the shortest training sample: a static label shape)."""

    capacity: int
    rows: int
    max_seqs: int


def pack_layout(cfg: RunConfig, lengths: np.ndarray) -> PackLayout:
    """The packed batch shape for these training ``lengths`` (see ``batching.pack_rows``)."""
    b = cfg.batching
    c = b.pack_len or cfg.data.max_len
    if b.pack_rows:
        rows = b.pack_rows
    elif b.max_tokens:
        rows = max(1, b.max_tokens // c)
    else:
        rows = max(1, -(-b.batch_size * float(np.mean(np.minimum(lengths, c))) // c)) if len(lengths) else 1
    shortest = max(1, int(np.min(lengths))) if len(lengths) else 1
    return PackLayout(capacity=c, rows=int(rows), max_seqs=int(rows) * max(1, c // shortest))


def eval_batch_rows(bundle: DataBundle, cfg: RunConfig) -> list[list[int]]:
    """Per bucket (aligned with ``bundle.bounds``): the one batch size evaluation batches are filled up to, the
    largest batch training runs in that bucket (the full size; the partial size where the training split has fewer
    samples than one full batch and keeps it; the full size for a bucket training never uses)."""
    b = cfg.batching
    s = BucketBatchSampler(bundle.splits["train"].lengths, bundle.bounds, batch_size=b.batch_size,
                           max_tokens=b.max_tokens,
                           round_batch_to=8 if b.round_to % 8 == 0 else 1)
    counts = np.bincount(s.bucket_of, minlength=len(bundle.bounds))
    return [[int(n) if 0 < n < size and not b.drop_last else size] for size, n in zip(s.batch_sizes, counts)]


def make_loader(bundle: DataBundle, split: str, cfg: RunConfig, train: bool, device: torch.device,
                world_size: int = 1, rank: int = 0) -> DataLoader:
    """A DataLoader over ``split`` with a :class:`BucketBatchSampler` and the task's padded-batch collate
    (``bundle.task``: :func:`~train.data.causal_collate.pad_collate_for`; packed training batches:
    :func:`~train.data.causal_collate.pack_collate_for`).

    Training: seeded shuffle, the configured token budget and ``drop_last``. Evaluation: no
    shuffle, nothing dropped, the same buckets and batch sizes, each bucket's last (partial) batch filled up to
    the full training batch with ignored rows (``pad_to="bound"``: :func:`eval_batch_rows`), so evaluation runs
    one training shape per bucket and compiles one graph per bucket; under DDP
    each rank gets every ``world_size``-th batch (:class:`ShardedBatchSampler`, nothing repeated).
    Each loader draws its workers' base seed from its own generator, not the global torch RNG, so
    starting an epoch or an evaluation never shifts the dropout stream (exact resume relies on it).
    ``data.max_eval_samples`` (evaluation only): the split's first N examples, the same ones every time.
    """
    b = cfg.batching
    generator = torch.Generator()
    generator.manual_seed(cfg.train.seed)
    if b.method == "packed" and train:
        layout = pack_layout(cfg, bundle.splits[split].lengths)
        packed = PackedBatchSampler(bundle.splits[split].lengths, layout.capacity, layout.rows, seed=cfg.train.seed,
                                    window=b.pack_window, drop_last=b.drop_last, world_size=world_size, rank=rank)
        compiled = cfg.compile.enabled == "true" or (cfg.compile.enabled == "auto" and device.type == "cuda")
        return DataLoader(RowDataset(bundle.splits[split]), batch_sampler=packed,
                          collate_fn=pack_collate_for(bundle.task, bundle.pad_id, layout.capacity, layout.rows,
                                                      layout.max_seqs, static_rows=compiled).collate_items,
                          num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                          persistent_workers=cfg.data.num_workers > 0, generator=generator)
    batches: BucketBatchSampler | LengthGroupedBatchSampler | ShardedBatchSampler
    if b.method == "hf-group-by-length" and train:
        if world_size > 1:
            raise UserError("batching.method=hf-group-by-length is a single-process baseline; use optimal with DDP")
        batches = LengthGroupedBatchSampler(bundle.splits[split].lengths, b.batch_size, cfg.train.seed, b.drop_last)
    else:
        shard_train = world_size if train else 1
        lengths = bundle.splits[split].lengths  # evaluation: the first data.max_eval_samples (None: all)
        sampler = BucketBatchSampler(
            lengths if train else lengths[:cfg.data.max_eval_samples], bundle.bounds, batch_size=b.batch_size,
            max_tokens=b.max_tokens,
            round_batch_to=8 if b.round_to % 8 == 0 else 1, shuffle=train, seed=cfg.train.seed,
            drop_last=b.drop_last if train else False, world_size=shard_train, rank=rank if train else 0)
        batches = sampler if train or world_size == 1 else ShardedBatchSampler(sampler, world_size, rank)
    rows = eval_batch_rows(bundle, cfg) if not train and bundle.pad_to == "bound" else None
    return DataLoader(TokenDataset(bundle.splits[split]), batch_sampler=batches,
                      collate_fn=pad_collate_for(bundle.task, bundle.pad_id, bundle.bounds, bundle.pad_to, rows),
                      num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                      persistent_workers=cfg.data.num_workers > 0, generator=generator)

"""A collated batch on its way to the model: the device copy and a packed batch's extra forward arguments.

A batch is the dict the collators build (train/data/collate.py, train/data/packing.py): ``input_ids`` LongTensor[B, S],
``attention_mask`` BoolTensor[B, S], ``labels`` LongTensor[B] (packed: LongTensor[N], one slot per packed sample),
``real_tokens`` and ``truncated`` (ints), and for packed rows also ``position_ids`` / ``seq_index`` LongTensor[B, S]
and ``samples`` (int).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def move(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)`` on ``device`` (an asynchronous copy from pinned memory on CUDA)."""
    nb = device.type == "cuda"
    return (batch["input_ids"].to(device, non_blocking=nb), batch["attention_mask"].to(device, non_blocking=nb),
            batch["labels"].to(device, non_blocking=nb))


def packed_inputs(batch: dict, device: torch.device) -> dict[str, Any]:
    """A packed batch's extra forward arguments (train/data/packing.py): ``position_ids`` and ``seq_index``
    (LongTensor[R, C], on ``device``) and ``num_seqs`` (its samples' slots: a causal-LM batch says it, a classifier's
    is its label slots); ``{}`` for an ordinary batch."""
    if "position_ids" not in batch:
        return {}
    nb = device.type == "cuda"
    return {"position_ids": batch["position_ids"].to(device, non_blocking=nb),
            "seq_index": batch["seq_index"].to(device, non_blocking=nb),
            "num_seqs": int(batch.get("num_seqs", batch["labels"].shape[0]))}


def batch_samples(batch: dict) -> int:
    """Samples in ``batch``: ``samples`` for packed rows (several per row), else its rows."""
    return int(batch.get("samples", batch["input_ids"].shape[0]))


def epochs(loader: Any, epoch: int = 0) -> Iterator[tuple[int, dict]]:
    """``(epoch, batch)`` for ever: every batch of ``loader``, epoch after epoch from ``epoch``, its batch sampler's
    ``set_epoch`` called before each pass (a new seeded order per epoch)."""
    while True:
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1

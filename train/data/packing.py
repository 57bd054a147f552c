"""Sequence packing without cross-contamination: several samples share one fixed-length row.

Each row of ``capacity`` tokens holds whole samples back to back; positions restart at 0 for
every sample, and attention is block-diagonal (a token attends only to tokens of its own sample;
padding attends to padding), so every sample's logits are what they would be alone
(Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination", arXiv:2107.02027;
the same idea as Hugging Face's ``DataCollatorWithFlattening``). Rows are filled by best-fit
decreasing bin packing; a batch is a fixed number of rows, so a run sees one shape
``[rows_per_batch, capacity]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager

import numpy as np
import torch
import torch.nn as nn


def pack_rows(lengths: Sequence[int], capacity: int, seed: int = 0, epoch: int = 0) -> list[list[int]]:
    """Best-fit decreasing: sample indices grouped into rows whose lengths sum to ≤ ``capacity``.

    Longest samples first (ties in a seeded random order, so rows differ per (seed, epoch)); each
    goes into the open row with the least room that still fits it, else a new row. Every index
    appears exactly once; a sample longer than ``capacity`` gets a row of its own (the collate
    truncates and counts it).

    Raises:
        ValueError: ``capacity`` < 1.
    """
    if capacity < 1:
        raise ValueError("capacity must be ≥ 1")
    lens = np.minimum(np.asarray(lengths, dtype=np.int64), capacity)
    perm = np.random.default_rng([seed, epoch]).permutation(len(lens))
    order = perm[np.argsort(-lens[perm], kind="stable")]
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # by_room[r]: open rows with r free tokens
    rows: list[list[int]] = []
    for i in order.tolist():
        need = int(lens[i])
        for room in range(need, capacity + 1):
            if by_room[room]:
                row = by_room[room].pop()
                break
        else:
            row, room = len(rows), capacity
            rows.append([])
        rows[row].append(i)
        by_room[room - need].append(row)
    return rows


def packed_batches(lengths: Sequence[int], capacity: int, rows_per_batch: int, seed: int = 0,
                   epoch: int = 0) -> list[list[list[int]]]:
    """One epoch: :func:`pack_rows`, rows shuffled (seeded), cut into batches of ``rows_per_batch`` rows."""
    rows = pack_rows(lengths, capacity, seed, epoch)
    order = np.random.default_rng([seed, epoch, 1]).permutation(len(rows))
    rows = [rows[i] for i in order]
    return [rows[i : i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


class PackCollate:
    """Collate rows of samples ``[[(ids, label), …], …]`` into one packed batch of static shape [R, C].

    Returns a dict: ``input_ids`` LongTensor[R, C], ``position_ids`` LongTensor[R, C] (restarting at 0
    per sample), ``seq_index`` LongTensor[R, C] (the sample's number in ``labels``, −1 on padding),
    ``attention_mask`` BoolTensor[R, C] (True = real token), ``labels`` LongTensor[N], ``real_tokens``
    int, ``truncated`` int (samples longer than C, cut keeping their last token). Missing rows of a
    short last batch are all padding, so the shape never changes.
    """

    def __init__(self, pad_id: int, capacity: int, rows_per_batch: int) -> None:
        self.pad_id, self.capacity, self.rows = pad_id, capacity, rows_per_batch

    def __call__(self, rows: list[list[tuple[np.ndarray, int]]]) -> dict:
        if len(rows) > self.rows:
            raise ValueError(f"{len(rows)} rows in a batch of {self.rows}")
        c = self.capacity
        ids = torch.full((self.rows, c), self.pad_id, dtype=torch.long)
        pos = torch.zeros((self.rows, c), dtype=torch.long)
        seq = torch.full((self.rows, c), -1, dtype=torch.long)
        labels, truncated = [], 0
        for r, row in enumerate(rows):
            at = 0
            for sample_ids, label in row:
                if len(sample_ids) > c:
                    sample_ids = np.concatenate([sample_ids[: c - 1], sample_ids[-1:]])
                    truncated += 1
                n = len(sample_ids)
                if at + n > c:
                    raise ValueError(f"row {r} holds more than {c} tokens")
                ids[r, at : at + n] = torch.from_numpy(sample_ids.astype(np.int64))
                pos[r, at : at + n] = torch.arange(n)
                seq[r, at : at + n] = len(labels)
                labels.append(label)
                at += n
        mask = seq >= 0
        return {"input_ids": ids, "position_ids": pos, "seq_index": seq, "attention_mask": mask,
                "labels": torch.tensor(labels, dtype=torch.long), "real_tokens": int(mask.sum()), "truncated": truncated}


def packed_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_index: torch.Tensor,
                   num_seqs: int, blocks_context: Callable[[], ContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """Logits FloatTensor[num_seqs, C] of an :class:`~train.model.EncoderClassifier` on a packed batch.

    The same modules as ``model.forward`` with per-sample positions, a block-diagonal bool mask
    [R, 1, C, C] (``seq_index`` equal; padding attends to padding, so no query row is fully
    masked) and pooling per sample (mean over its tokens, or its first token for ``cls``).
    """
    x = model.emb_drop(model.emb_norm(model.tok_emb(input_ids) + model.pos_emb(position_ids)))  # [R, C, H]
    attn_mask = (seq_index[:, :, None] == seq_index[:, None, :])[:, None]  # [R, 1, C, C]
    with blocks_context():
        for layer in model.layers:
            x = layer(x, attn_mask)
    h = model.final_norm(x.float()).reshape(-1, x.shape[-1])  # [R·C, H]
    idx = seq_index.reshape(-1)
    if model.spec.pooling == "cls":
        first = (idx >= 0) & (position_ids.reshape(-1) == 0)
        pooled = torch.zeros(num_seqs, h.shape[1], dtype=h.dtype, device=h.device).index_copy(0, idx[first], h[first])
    else:
        real = idx >= 0
        sums = torch.zeros(num_seqs, h.shape[1], dtype=h.dtype, device=h.device).index_add(0, idx[real], h[real])
        counts = torch.bincount(idx[real], minlength=num_seqs).clamp_min(1).to(h.dtype)
        pooled = sums / counts[:, None]
    return model.head(pooled).float()

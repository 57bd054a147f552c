"""Sequence packing: every sample once, rows within capacity, and logits identical to unpacked."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data.packing import PackCollate, pack_rows, packed_batches, packed_forward
from train.model import EncoderClassifier, resolve_spec


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=300), cap=st.integers(8, 64), seed=st.integers(0, 3))
def test_pack_rows_exactly_once_within_capacity(lengths, cap, seed) -> None:
    rows = pack_rows(lengths, cap, seed=seed)
    assert Counter(i for r in rows for i in r) == Counter(range(len(lengths)))
    assert all(sum(min(lengths[i], cap) for i in r) <= cap for r in rows)
    assert rows == pack_rows(lengths, cap, seed=seed)
    batches = packed_batches(lengths, cap, 4, seed=seed, epoch=1)
    assert sorted(i for b in batches for r in b for i in r) == list(range(len(lengths)))


def test_packing_is_dense_on_a_realistic_length_distribution() -> None:
    lengths = np.clip(np.random.default_rng(0).lognormal(3.2, 0.45, 5000).astype(int), 3, 128)
    rows = pack_rows(lengths, 128)
    assert lengths.sum() / (128 * len(rows)) > 0.97
    assert pack_rows(lengths, 128, epoch=1) != rows  # rows differ per epoch


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_packed_logits_equal_unpacked(pooling: str) -> None:
    torch.manual_seed(0)
    spec = resolve_spec("tiny", 50, 4, 16, 0.0, pooling, num_layers=2, hidden_size=32, num_heads=2, ffn_size=64)
    model = EncoderClassifier(spec).eval()
    rng = np.random.default_rng(0)
    samples = [(np.concatenate([[2], rng.integers(5, 50, n - 2), [3]]).astype(np.int32), k % 4)
               for k, n in enumerate([5, 9, 3, 12, 7, 4, 20])]  # the last one is longer than the capacity
    rows = pack_rows([len(s) for s, _ in samples], 16)
    batch = PackCollate(0, 16, rows_per_batch=len(rows) + 1)([[samples[i] for i in r] for r in rows])
    order = [i for r in rows for i in r]
    assert batch["truncated"] == 1 and batch["input_ids"].shape == (len(rows) + 1, 16)
    with torch.no_grad():
        packed = packed_forward(model, batch["input_ids"], batch["position_ids"], batch["seq_index"], len(order))
        for j, i in enumerate(order):
            ids = samples[i][0] if len(samples[i][0]) <= 16 else np.concatenate([samples[i][0][:15], samples[i][0][-1:]])
            x = torch.zeros(1, 16, dtype=torch.long)
            x[0, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            mask = torch.zeros(1, 16, dtype=torch.bool)
            mask[0, : len(ids)] = True
            torch.testing.assert_close(packed[j], model(x, mask)[0], rtol=1e-5, atol=1e-5)
    assert batch["labels"].tolist() == [samples[i][1] for i in order]

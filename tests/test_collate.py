"""Collate + sampler edge cases the issue lists, DataLoader workers / pin_memory, flat host memory, pad_to."""

import gc
import os
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from train.data import make_loader, prepare_data
from train.data.buckets import fit_boundaries, token_efficiency
from train.data.collate import PadCollate, TokenDataset
from train.data.sampler import BucketBatchSampler
from train.data.tokenizer import TokenizedSplit


def make_split(lengths, seed: int = 0) -> TokenizedSplit:
    rng = np.random.default_rng(seed)
    ids = [np.concatenate([[2], rng.integers(5, 50, n - 2), [3]]).astype(np.int32) if n >= 2
           else np.array([2], np.int32)
           for n in lengths]
    return TokenizedSplit(ids=ids, labels=np.arange(len(lengths)) % 3, lengths=np.asarray(lengths, np.int32),
                          truncated=0)


def test_sample_longer_than_largest_bound_is_truncated_and_counted_not_dropped() -> None:
    split = make_split([5, 7, 40])
    sampler = BucketBatchSampler(split.lengths, [8, 16], batch_size=4, shuffle=False)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == [0, 1, 2] and sampler.dropped_samples == 0
    batch = PadCollate(0, [8, 16])([TokenDataset(split)[i] for i in batches[-1]])
    long_row = batch["input_ids"][batches[-1].index(2)]
    assert batch["input_ids"].shape[1] == 16 and batch["truncated"] == 1
    assert long_row[-1].item() == 3 and long_row[:15].tolist() == split.ids[2][:15].tolist()  # [SEP] kept
    assert batch["real_tokens"] == int(batch["attention_mask"].sum())


def test_empty_buckets_are_skipped() -> None:
    lengths = [3] * 10 + [60] * 5  # bucket (8, 32] is empty
    for max_tokens in (None, 128):
        s = BucketBatchSampler(lengths, [8, 32, 64], batch_size=4, max_tokens=max_tokens)
        batches = list(s)
        assert len(batches) == len(s)
        assert Counter(i for b in batches for i in b) == Counter(range(15))
        collate = PadCollate(0, [8, 32, 64])
        shapes = {collate.target_length(max(lengths[i] for i in b)) for b in batches}
        assert shapes == {8, 64}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_sample_dataset(world: int) -> None:
    keep = [BucketBatchSampler([9], [16], batch_size=8, world_size=world, rank=r) for r in range(world)]
    assert [list(s) for s in keep] == [[[0]]] * world and keep[0].repeated_samples == world - 1
    drop = BucketBatchSampler([9], [16], batch_size=8, drop_last=True, world_size=world)
    assert list(drop) == [] and len(drop) == 0 and drop.dropped_samples == 1
    batch = PadCollate(0, [16])([TokenDataset(make_split([9]))[0]])
    assert batch["input_ids"].shape == (1, 16) and batch["attention_mask"].sum() == 9


def test_all_samples_the_same_length() -> None:
    lengths = [11] * 100
    bounds = fit_boundaries(lengths, 8, "optimal")
    assert bounds == [11] and token_efficiency(np.array(lengths), bounds) == 1.0
    split = make_split(lengths)
    loader = DataLoader(TokenDataset(split), batch_sampler=BucketBatchSampler(lengths, bounds, batch_size=32),
                        collate_fn=PadCollate(0, bounds))
    batches = list(loader)
    assert {b["input_ids"].shape[1] for b in batches} == {11}
    assert all(b["attention_mask"].all() for b in batches) and sum(len(b["labels"]) for b in batches) == 100


def test_dataloader_with_workers_and_pin_memory_matches_in_process() -> None:
    lengths = np.random.default_rng(1).integers(2, 30, 300).tolist()
    split, bounds = make_split(lengths), [8, 16, 30]

    def run(workers: int, pin: bool) -> list[dict]:
        sampler = BucketBatchSampler(lengths, bounds, batch_size=16, seed=3)
        loader = DataLoader(TokenDataset(split), batch_sampler=sampler, collate_fn=PadCollate(0, bounds),
                            num_workers=workers, pin_memory=pin, persistent_workers=workers > 0)
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            out.append([b for b in loader])
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator warns and does nothing
        ref, par = run(0, False), run(2, True)
    for e_ref, e_par in zip(ref, par):
        assert len(e_ref) == len(e_par)
        for a, b in zip(e_ref, e_par):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
            if torch.cuda.is_available():
                assert b["input_ids"].is_pinned()
    # set_epoch reached the sampler
    assert [b["labels"].tolist() for b in par[0]] != [b["labels"].tolist() for b in par[1]]
    assert sum(len(b["labels"]) for b in par[1]) == 300


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_host_memory_flat_across_epochs() -> None:
    n, s = 3000, 200
    lengths = np.random.default_rng(0).integers(100, s + 1, n).tolist()
    split = make_split(lengths)
    sampler = BucketBatchSampler(lengths, [150, s], batch_size=32)
    loader = DataLoader(TokenDataset(split), batch_sampler=sampler, collate_fn=PadCollate(0, [150, s]))
    epoch_bytes = n * s * 9  # int64 ids + bool mask of every padded batch in one epoch
    rss, tensors = [], []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch["input_ids"].sum()
        del batch
        gc.collect()
        rss.append(_rss_bytes())
        tensors.append(sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor)))
    assert tensors[1] == tensors[-1]
    assert rss[-1] - rss[1] < epoch_bytes / 2, (rss, epoch_bytes)  # a collate keeping its batches would grow ≥ 4 epochs


def test_pad_to_batch_max_inside_buckets(tiny_cfg) -> None:
    shapes = {}
    for pad_to in ("bound", "batch-max"):
        cfg = tiny_cfg(f"batching.pad_to={pad_to}", "batching.batch_size=4")
        bundle = prepare_data(cfg, None, notice=lambda _m: None)
        loader = make_loader(bundle, "train", cfg, train=True, device=torch.device("cpu"))
        shapes[pad_to] = {b["input_ids"].shape[1] for b in loader}
        for b in loader:
            assert b["input_ids"].shape[1] == int(b["attention_mask"].sum(1).max()) or pad_to == "bound"
    assert shapes["bound"] <= set(bundle.bounds)
    assert len(shapes["batch-max"]) > len(shapes["bound"])

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data.sampler import BucketBatchSampler

lengths_st = st.lists(st.integers(1, 64), min_size=1, max_size=200)


def all_ranks(lengths, bounds, **kw):
    w = kw.get("world_size", 1)
    samplers = [BucketBatchSampler(lengths, bounds, rank=r, **kw) for r in range(w)]
    return samplers, [list(s) for s in samplers]


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 6), bs=st.integers(1, 16), world=st.integers(1, 4),
       drop_last=st.booleans(), max_tokens=st.one_of(st.none(), st.integers(64, 512)), seed=st.integers(0, 5))
def test_exactly_once_or_counted(lengths, k, bs, world, drop_last, max_tokens, seed) -> None:
    bounds = sorted(set(np.quantile(lengths, np.linspace(0, 1, k + 1)[1:], method="higher").astype(int).tolist()))
    samplers, plans = all_ranks(lengths, bounds, batch_size=bs, max_tokens=max_tokens, world_size=world,
                                drop_last=drop_last, seed=seed)
    assert len({len(p) for p in plans}) == 1  # every rank runs the same number of steps
    assert all(len(p) == len(s) for p, s in zip(plans, samplers))
    seen = Counter(i for plan in plans for batch in plan for i in batch)
    s = samplers[0]
    if drop_last:
        assert all(c == 1 for c in seen.values())
        assert len(seen) + s.dropped_samples == len(lengths)
    else:
        assert set(seen) == set(range(len(lengths)))
        assert sum(seen.values()) - len(lengths) == s.repeated_samples
    for plan in plans:
        for batch in plan:
            b = bounds[min(np.searchsorted(bounds, max(lengths[i] for i in batch)), len(bounds) - 1)]
            if max_tokens is not None and len(batch) > 1:
                assert len(batch) * b <= max_tokens  # never over the token budget
            assert len({min(np.searchsorted(bounds, lengths[i]), len(bounds) - 1) for i in batch}) == 1


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, bs=st.integers(1, 8), cut=st.integers(0, 50), seed=st.integers(0, 3))
def test_resume_yields_exactly_the_remaining_batches(lengths, bs, cut, seed) -> None:
    bounds = [8, 32, 64]
    full = BucketBatchSampler(lengths, bounds, batch_size=bs, seed=seed)
    full.set_epoch(2)
    expected = list(full)
    first = BucketBatchSampler(lengths, bounds, batch_size=bs, seed=seed)
    first.set_epoch(2)
    it = iter(first)
    taken = [next(it) for _ in range(min(cut, len(expected)))]
    resumed = BucketBatchSampler(lengths, bounds, batch_size=bs, seed=seed)
    resumed.load_state_dict(first.state_dict())
    assert taken + list(resumed) == expected


def test_determinism_per_seed_and_epoch() -> None:
    lengths = np.random.default_rng(0).integers(1, 64, 500)
    a, b = BucketBatchSampler(lengths, [16, 32, 64], 8, seed=1), BucketBatchSampler(lengths, [16, 32, 64], 8, seed=1)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    c = BucketBatchSampler(lengths, [16, 32, 64], 8, seed=2)
    assert list(c) != list(b)


def test_token_budget_sizes() -> None:
    s = BucketBatchSampler([10] * 10 + [100] * 10, [16, 128], max_tokens=256)
    assert s.batch_sizes == [16, 2]
    s8 = BucketBatchSampler([10] * 10, [16, 128], max_tokens=300, round_batch_to=8)
    assert s8.batch_sizes == [16, 2]  # 18 → 16 (multiple of 8); 2 stays ≥ 1

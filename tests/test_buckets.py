import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from train.data.buckets import BucketPlan, assign_buckets, fit_boundaries, token_efficiency
from train.errors import UserError


def padding(lengths: np.ndarray, bounds: list[int]) -> int:
    b = np.asarray(bounds)[assign_buckets(lengths, bounds)]
    return int((b - lengths).sum())


def brute_force_min_padding(lengths: np.ndarray, k: int) -> int:
    values = sorted(set(lengths.tolist()))
    best = None
    for r in range(1, k + 1):
        for cut in itertools.combinations(values[:-1], r - 1):
            bounds = sorted(set(cut) | {values[-1]})
            p = padding(lengths, bounds)
            best = p if best is None else min(best, p)
    return best


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_optimal_matches_brute_force(seed: int, k: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, size=int(rng.integers(1, 60)))
    bounds = fit_boundaries(lengths, k, "optimal")
    assert len(bounds) <= k and bounds[-1] == lengths.max()
    assert padding(lengths, bounds) == brute_force_min_padding(lengths, k)


def test_optimal_is_never_worse_than_quantile_or_kmeans() -> None:
    lengths = np.clip(np.random.default_rng(0).lognormal(3.2, 0.45, 5000).astype(int), 3, 128)
    opt = token_efficiency(lengths, fit_boundaries(lengths, 8, "optimal"))
    for method in ("quantile", "kmeans"):
        assert opt >= token_efficiency(lengths, fit_boundaries(lengths, 8, method)) - 1e-12


def test_round_to_multiple_of_8_capped_at_max_len() -> None:
    lengths = np.array([3, 9, 17, 30, 126])
    bounds = fit_boundaries(lengths, 3, "optimal", round_to=8, max_len=126)
    assert all(b % 8 == 0 or b == 126 for b in bounds) and bounds[-1] == 126


def test_edge_cases_single_value_and_one_sample() -> None:
    assert fit_boundaries(np.full(50, 7), 8, "optimal") == [7]
    assert fit_boundaries(np.array([5]), 4, "kmeans") == [5]
    assert token_efficiency(np.full(50, 7), [7]) == 1.0
    with pytest.raises(UserError):
        fit_boundaries(np.array([], dtype=int), 4)


def test_plan_roundtrip_and_fingerprint_mismatch(tmp_path: Path) -> None:
    lengths = np.array([4, 5, 9, 12, 30])
    plan = BucketPlan.fit(lengths, 2, "optimal", 1, 64, "data-a", "tok-a")
    plan.save(tmp_path / "b.json")
    raw = json.loads((tmp_path / "b.json").read_text())
    assert raw["schema_version"] == 1 and raw["bounds"] == plan.bounds and sum(raw["counts"]) == 5
    assert BucketPlan.load(tmp_path / "b.json", "data-a", "tok-a").bounds == plan.bounds
    with pytest.raises(UserError, match="fitted for another data.*--buckets-force"):
        BucketPlan.load(tmp_path / "b.json", "data-b", "tok-a")
    assert BucketPlan.load(tmp_path / "b.json", "data-b", "tok-b", force=True).bounds == plan.bounds
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not a bucket-boundaries JSON"):
        BucketPlan.load(tmp_path / "bad.json", "d", "t")

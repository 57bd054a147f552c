"""Bucket boundaries for length-bucketed batching: fit them offline, save/load them as JSON.

A bucket plan is a sorted list of upper bounds ``b_1 < … < b_K``; a sample of length ``L`` goes
to the smallest bucket with ``b_k ≥ L`` and is padded to ``b_k``, so a run sees at most K
sequence lengths (static shapes for torch.compile / CUDA graphs).

Methods:

* ``optimal`` — the exact minimum-padding partition of the length histogram into K contiguous
  buckets: dynamic programming over the m distinct lengths, O(K·m²) (the classic optimal
  1-D segmentation DP, Bellman 1961; here m ≤ max_len so it takes milliseconds).
* ``quantile`` — bounds at the K length quantiles (each bound an observed length).
* ``kmeans`` — 1-D k-means on the lengths (scikit-learn ``KMeans``); a bucket's bound is its
  longest member. The original design's method.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from train.errors import UserError, atomic_write_text

SCHEMA_VERSION = 1
METHODS = ("optimal", "quantile", "kmeans")


def _round_up(x: int, multiple: int, cap: Optional[int]) -> int:
    r = int(math.ceil(x / multiple) * multiple)
    return min(r, cap) if cap is not None else r


def assign_buckets(lengths: np.ndarray, bounds: Sequence[int]) -> np.ndarray:
    """Bucket index (int64 [N]) of each length: the smallest k with ``bounds[k] ≥ length``.

    Lengths above the largest bound go to the last bucket (the collate truncates and counts them).
    """
    idx = np.searchsorted(np.asarray(bounds), np.asarray(lengths), side="left")
    return np.minimum(idx, len(bounds) - 1)


def token_efficiency(lengths: np.ndarray, bounds: Sequence[int]) -> float:
    """Real tokens ÷ tokens processed when every sample is padded to its bucket bound (in (0, 1])."""
    lengths = np.asarray(lengths, dtype=np.int64)
    b = np.asarray(bounds, dtype=np.int64)[assign_buckets(lengths, bounds)]
    return float(np.minimum(lengths, b).sum() / b.sum())


def _optimal(values: np.ndarray, counts: np.ndarray, k: int, round_to: int, cap: Optional[int]) -> list[int]:
    """Minimum-total-padding partition of the sorted distinct ``values`` (with ``counts``) into k runs.

    ``best[b, j]`` is the least padding that covers ``values[0..j]`` with b buckets; the last
    bucket spans ``values[i..j]`` and costs ``bound_j · count(i..j) − sum(i..j)``. Splitting a
    bucket never adds padding, so using exactly ``k = min(K, m)`` buckets is optimal.
    """
    m = len(values)
    c_cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)
    s_cum = np.concatenate([[0], np.cumsum(counts * values)]).astype(np.float64)
    bound = np.array([_round_up(int(v), round_to, cap) for v in values], dtype=np.float64)
    best = np.full((k + 1, m), np.inf)
    arg = np.zeros((k + 1, m), dtype=np.int64)
    best[1] = bound * c_cum[1:] - s_cum[1:]
    for b in range(2, k + 1):
        for j in range(b - 1, m):
            i = np.arange(b - 1, j + 1)  # first distinct length of the last bucket
            total = best[b - 1, i - 1] + bound[j] * (c_cum[j + 1] - c_cum[i]) - (s_cum[j + 1] - s_cum[i])
            t = int(np.argmin(total))
            best[b, j], arg[b, j] = total[t], i[t]
    bounds, j = [], m - 1
    for b in range(k, 0, -1):
        bounds.append(int(bound[j]))
        j = int(arg[b, j]) - 1
    return sorted(set(bounds))


def fit_boundaries(lengths: Sequence[int], num_buckets: int, method: str = "optimal",
                   round_to: int = 1, max_len: Optional[int] = None) -> list[int]:
    """Fit at most ``num_buckets`` sorted upper bounds (ints) to ``lengths``.

    Args:
        lengths: token lengths of the training split (ints ≥ 1).
        num_buckets: K ≥ 1.
        method: ``optimal``, ``quantile`` or ``kmeans``.
        round_to: round each bound up to a multiple of this (8 for tensor cores); 1 = exact.
        max_len: never round a bound above this (the model's position limit).

    Returns:
        Sorted distinct bounds; the last one ≥ ``max(lengths)`` (unless capped by ``max_len``).

    Raises:
        UserError: empty ``lengths``, K < 1 or an unknown method.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        raise UserError("cannot fit bucket boundaries: no lengths (is the training split empty?)")
    if num_buckets < 1:
        raise UserError("batching.num_buckets must be ≥ 1")
    values, counts = np.unique(arr, return_counts=True)
    k = min(num_buckets, len(values))
    if method == "optimal":
        return _optimal(values, counts, k, round_to, max_len)
    if method == "quantile":
        qs = np.quantile(arr, np.arange(1, k + 1) / k, method="higher")
        raw = [int(q) for q in qs]
    elif method == "kmeans":
        from sklearn.cluster import KMeans

        km = KMeans(n_clusters=k, n_init=10, random_state=0).fit(values.reshape(-1, 1).astype(np.float64),
                                                                 sample_weight=counts.astype(np.float64))
        raw = [int(values[km.labels_ == c].max()) for c in np.unique(km.labels_)]
    else:
        raise UserError(f"unknown bucket method {method!r}; choose one of {', '.join(METHODS)}")
    raw.append(int(values[-1]))
    return sorted({_round_up(b, round_to, max_len) for b in raw})


@dataclass
class BucketPlan:
    """A fitted bucket plan as saved to JSON (``schema_version`` 1)."""

    method: str
    num_buckets: int
    bounds: list[int]
    counts: list[int]
    predicted_token_efficiency: float
    data_fingerprint: str
    tokenizer_fingerprint: str
    max_len: int
    round_to: int
    created_at: str
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def fit(cls, lengths: np.ndarray, num_buckets: int, method: str, round_to: int, max_len: int,
            data_fingerprint: str, tokenizer_fingerprint: str) -> "BucketPlan":
        bounds = fit_boundaries(lengths, num_buckets, method, round_to, max_len)
        counts = np.bincount(assign_buckets(lengths, bounds), minlength=len(bounds))
        return cls(method=method, num_buckets=num_buckets, bounds=bounds, counts=[int(c) for c in counts],
                   predicted_token_efficiency=round(token_efficiency(lengths, bounds), 6),
                   data_fingerprint=data_fingerprint, tokenizer_fingerprint=tokenizer_fingerprint,
                   max_len=max_len, round_to=round_to,
                   created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename)."""
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, data_fingerprint: str, tokenizer_fingerprint: str,
             force: bool = False) -> "BucketPlan":
        """Load and check a plan against the current data split and tokenizer.

        Raises:
            UserError: missing/invalid file, unknown schema, or a fingerprint mismatch (unless ``force``).
        """
        p = Path(path)
        if not p.is_file():
            raise UserError(f"batching.boundaries_file={str(p)!r}: no such file; create it with `make buckets`")
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
            plan = cls(**raw)
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
            raise UserError(f"{p}: not a bucket-boundaries JSON file ({exc.__class__.__name__}); "
                            "regenerate it with `make buckets`") from None
        if plan.schema_version != SCHEMA_VERSION:
            raise UserError(f"{p}: schema_version {plan.schema_version}, this version reads {SCHEMA_VERSION}; "
                            "regenerate it with `make buckets`")
        bounds = plan.bounds if isinstance(plan.bounds, list) else []
        if (not bounds or not all(type(b) is int for b in bounds) or sorted(set(bounds)) != bounds or bounds[0] < 1):
            raise UserError(f"{p}: 'bounds' must be a non-empty strictly increasing list of positive ints "
                            f"(got {plan.bounds!r}); regenerate it with `make buckets`")
        if not force:
            for what, have, want in (("data", plan.data_fingerprint, data_fingerprint),
                                     ("tokenizer", plan.tokenizer_fingerprint, tokenizer_fingerprint)):
                if have != want:
                    raise UserError(f"{p}: fitted for another {what} ({what} fingerprint {have}, "
                                    f"this run's is {want}); "
                                    "refit with `make buckets`, or pass --buckets-force to use it anyway")
        return plan

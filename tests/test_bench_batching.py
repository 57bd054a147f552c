"""bench-batching: the HF grouping baseline, the exact epoch figures, the arithmetic, and a real small run."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import assert_clean_error, run_cli
from train.bench.batching import Method, build_methods, epoch_stats, run_batching_bench, summarize
from train.config.bench import BenchBatchingConfig
from train.data.buckets import fit_boundaries, token_efficiency
from train.data.grouping import length_grouped_batches, length_grouped_indices
from train.errors import UserError

NAMES = ["pad-to-max", "random-pad-to-batch-max", "hf-group-by-length", "kmeans-5", "optimal-6", "optimal-6-max-tokens"]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=400), bs=st.integers(1, 16),
       mult=st.one_of(st.none(), st.integers(1, 5)), seed=st.integers(0, 3))
def test_hf_length_grouping_megabatches(lengths, bs, mult, seed) -> None:
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    order = length_grouped_indices(lengths, bs, mult, g)
    assert sorted(order) == list(range(len(lengths)))  # a permutation: every sample once
    assert lengths[order[0]] == max(lengths)  # the longest sample comes first
    m = mult or max(1, min(len(lengths) // (bs * 4), 50))
    size = m * bs
    for start in range(0, len(order), size):
        mb = [lengths[i] for i in order[start : start + size]]
        rest = mb[1:]  # the first slot of each megabatch may hold the swapped longest sample
        assert rest == sorted(rest, reverse=True)
    batches = length_grouped_batches(lengths, bs, seed=seed, epoch=1)
    assert batches == length_grouped_batches(lengths, bs, seed=seed, epoch=1)
    assert all(len(b) == bs for b in batches[:-1]) and sum(map(len, batches)) == len(lengths)


def lognormal_lengths(n: int = 2000, seed: int = 0) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(3.2, 0.45, n).astype(np.int64), 3, 128)


def test_methods_are_the_issue_rows_and_cover_every_sample_once() -> None:
    lengths = lognormal_lengths()
    bc = BenchBatchingConfig(num_buckets=6, batch_size=32, max_tokens=1024)
    methods = build_methods(lengths, 128, bc, seed=0)
    assert [m.name for m in methods] == NAMES + ["optimal-6-batch-max", "packed-128"]
    for m in methods:
        flat = [i for b in m.batches for r in b for i in r] if m.packed else [i for b in m.batches for i in b]
        assert Counter(flat) == Counter(range(len(lengths))), m.name
    stats = {m.name: epoch_stats(m, lengths) for m in methods}
    assert stats["pad-to-max"]["token_efficiency"] == pytest.approx(lengths.mean() / 128)
    assert stats["pad-to-max"]["distinct_shapes"] == 1
    opt = fit_boundaries(lengths, 6, "optimal", max_len=128)
    # padded to the bound, every sample costs exactly its bucket bound: the plan's efficiency is the DP's
    assert stats["optimal-6"]["token_efficiency"] == pytest.approx(token_efficiency(lengths, opt))
    assert stats["optimal-6"]["distinct_shapes"] <= 6 and stats["kmeans-5"]["distinct_shapes"] <= 5
    assert stats["optimal-6"]["token_efficiency"] >= stats["kmeans-5"]["token_efficiency"]
    assert stats["optimal-6-batch-max"]["token_efficiency"] >= stats["optimal-6"]["token_efficiency"]
    assert stats["random-pad-to-batch-max"]["token_efficiency"] > stats["pad-to-max"]["token_efficiency"]
    assert stats["hf-group-by-length"]["token_efficiency"] > stats["random-pad-to-batch-max"]["token_efficiency"]
    packed = stats["packed-128"]
    assert packed["distinct_shapes"] == 1 and packed["token_efficiency"] > stats["optimal-6"]["token_efficiency"]
    assert packed["padded_tokens_per_epoch"] == packed["batches_per_epoch"] * 8 * 128  # 1024 // 128 rows per batch
    budget = [len(b) * min(x for x in opt if x >= lengths[b].max()) for b in methods[5].batches]
    assert max(budget) <= 1024


def test_summary_medians_and_ratios() -> None:
    methods = [Method("pad-to-max", "", [8], "bound", [[0]]), Method("x", "", [8], "bound", [[0]])]
    stats = {"pad-to-max": {"token_efficiency": 0.25}, "x": {"token_efficiency": 0.75}}
    win = {"pad-to-max": [{"samples": 10, "real_tokens": 100, "padded_tokens": 400, "seconds": s} for s in (1, 2, 10)],
           "x": [{"samples": 10, "real_tokens": 100, "padded_tokens": 130, "seconds": s} for s in (0.5, 0.25, 5)]}
    rows = {r["name"]: r for r in summarize(methods, stats, win)}
    assert rows["pad-to-max"]["samples_per_s"] == 5.0  # median of 10, 5, 1
    assert rows["x"]["samples_per_s"] == 20.0 and rows["x"]["tokens_per_s"] == 200.0
    assert rows["x"]["samples_per_s_vs_pad_to_max"] == 4.0 and rows["x"]["token_efficiency_vs_pad_to_max"] == 3.0


def test_bench_config_rejects_bad_sizes() -> None:
    with pytest.raises(UserError, match="bench_batching.windows=0 is out of range: it must be ≥ 1"):
        BenchBatchingConfig(windows=0)


def test_bench_runs_small_and_writes_json_md_png(tiny_cfg, tmp_path: Path) -> None:
    cfg = tiny_cfg("train.run_id=bench", "bench_batching.num_buckets=3", "bench_batching.batch_size=8",
                   "bench_batching.max_tokens=128", "bench_batching.window_samples=8", "bench_batching.windows=2",
                   "bench_batching.warmup_windows=1", "bench_batching.k_table_max=4")
    run_dir = Path(cfg.train.output_dir) / "bench"
    run_dir.mkdir(parents=True)
    result = run_batching_bench(cfg, run_dir, notice=lambda _m: None)
    saved = json.loads((run_dir / "bench-batching.json").read_text())
    names = [r["name"] for r in saved["results"]]
    assert names[:6] == ["pad-to-max", "random-pad-to-batch-max", "hf-group-by-length", "kmeans-5", "optimal-3",
                         "optimal-3-max-tokens"]
    for r in saved["results"]:
        assert r["samples_per_s"] > 0 and r["tokens_per_s"] > 0 and len(r["samples_per_s_windows"]) == 2
        assert 0 < r["token_efficiency"] <= 1 and r["distinct_shapes"] >= 1
    assert saved["targets"]["optimal_distinct_shapes"]["value"] <= 3
    assert names[-1] == "packed-32" and saved["targets"]["packed_token_efficiency"]["distinct_shapes"] == 1
    assert [t["k"] for t in saved["dp_optimum_by_k"]] == [1, 2, 3, 4]
    assert result["results"][0]["samples_per_s_vs_pad_to_max"] == 1.0
    assert "| `optimal-3` |" in (run_dir / "bench-batching.md").read_text()
    assert (run_dir / "bench-batching.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_bench_size_is_a_clean_error(tmp_path: Path) -> None:
    assert_clean_error(run_cli("bench-batching", "--windows", "0", f"train.output_dir={tmp_path}"),
                       "bench_batching.windows=0 is out of range: it must be ≥ 1")

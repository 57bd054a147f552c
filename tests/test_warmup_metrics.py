"""Warm-up leaves no trace in the metrics, and evaluation runs only the training shapes (so warm-up compiles
what the bucket plan promises). Compiles with ``backend=eager``: dynamo's tracing and guards, no inductor."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from train.compiling.warmup import planned_shapes
from train.data import make_loader, prepare_data
from train.data.collate import IGNORE_LABEL, PadCollate, TokenDataset
from train.evaluation import evaluate
from train.precision import PrecisionPolicy
from train.run.training import run_training
from train.setup import build_model, seed_everything

EAGER_COMPILE = ["compile.enabled=true", "compile.backend=eager", "compile.warmup_window=2",
                 "compile.warmup_max_steps=3", "compile.warmup_cv=0.9", "train.max_steps=10", "train.log_every=5",
                 "train.eval_every=100"]


@pytest.fixture
def compile_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _records(report: dict) -> list[dict]:
    lines = (Path(report["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and r.get("event") is None]


def test_first_record_is_the_same_with_and_without_warmup(tiny_cfg, compile_env) -> None:
    with_warmup = run_training(tiny_cfg(*EAGER_COMPILE, "train.run_id=warm"), t_start=time.perf_counter())
    torch._dynamo.reset()
    without = run_training(tiny_cfg(*EAGER_COMPILE, "compile.warmup=false", "train.run_id=cold"),
                           t_start=time.perf_counter())
    warm = json.loads((Path(with_warmup["run_dir"]) / "warmup.json").read_text())
    assert warm["restored_bit_exact"] and warm["totals"]["train_shapes"] >= 2  # warm-up really ran training steps
    a, b = _records(with_warmup), _records(without)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [5, 10]
    for key in ("loss", "grad_norm", "clipped_fraction", "skipped_steps", "steps_in_window"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-5), key
    assert a[1]["loss"] == pytest.approx(b[1]["loss"], rel=1e-5)
    assert with_warmup["quality"]["final_train_loss"] == pytest.approx(without["quality"]["final_train_loss"], rel=1e-5)


def test_warmup_compiles_the_training_shapes_plus_their_evaluation_graphs(tiny_cfg, compile_env) -> None:
    report = run_training(tiny_cfg(*EAGER_COMPILE, "train.max_steps=2"), t_start=time.perf_counter())
    warm = json.loads((Path(report["run_dir"]) / "warmup.json").read_text())
    train = {(r["batch_size"], r["seq_len"]) for r in warm["shapes"] if r["phase"] == "train"}
    evals = {(r["batch_size"], r["seq_len"]) for r in warm["shapes"] if r["phase"] == "eval"}
    assert evals <= train and warm["totals"]["shapes"] == len(train) + len(evals)
    assert len(evals) <= len(report["batching"]["bucket_bounds"])  # one evaluation graph per bucket
    # the training shapes are the plan's: per bucket the full batch and (no drop_last) one partial batch
    assert len(train) <= 2 * len(report["batching"]["bucket_bounds"])
    assert report["compile"]["recompiles_after_warmup"] == 0


def test_evaluation_batches_take_training_shapes_and_filler_rows_count_nowhere(tiny_cfg) -> None:
    cfg = tiny_cfg()
    device = torch.device("cpu")
    seed_everything(0)
    bundle = prepare_data(cfg, None, notice=lambda _m: None)
    train_loader = make_loader(bundle, "train", cfg, train=True, device=device)
    train_shapes = {k[1:] for k in planned_shapes(train_loader, "train")}
    for split in ("validation", "test"):
        loader = make_loader(bundle, split, cfg, train=False, device=device)
        shapes = {k[1:] for k in planned_shapes(loader, "eval")}
        assert shapes <= train_shapes, (split, shapes, train_shapes)
        assert len({s for _, s in shapes}) == len(shapes) <= len(bundle.bounds)  # one batch size per bucket
    loader = make_loader(bundle, "validation", cfg, train=False, device=device)
    batches = list(loader)
    assert sum(b["samples"] for b in batches) == len(bundle.splits["validation"])
    assert any((b["labels"] == IGNORE_LABEL).any() for b in batches)  # some batch was filled up
    # the same evaluation without filler rows gives the same numbers
    plain = DataLoader(TokenDataset(bundle.splits["validation"]), batch_sampler=loader.batch_sampler,
                       collate_fn=PadCollate(bundle.pad_id, bundle.bounds, bundle.pad_to))
    model = build_model(cfg, bundle).eval()
    policy = PrecisionPolicy.create("fp32", device)
    got = evaluate(model, loader, policy, bundle.num_classes, device)
    want = evaluate(model, plain, policy, bundle.num_classes, device)
    assert got["samples"] == want["samples"] == len(bundle.splits["validation"])
    assert got["accuracy"] == pytest.approx(want["accuracy"]) and got["macro_f1"] == pytest.approx(want["macro_f1"])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_collate_fills_a_partial_batch_to_the_smallest_training_size() -> None:
    import numpy as np

    collate = PadCollate(0, [4, 8], "bound", rows=[[6, 2], [3]])
    items = [(np.array([5, 6, 7]), 1), (np.array([5, 6]), 2), (np.array([9]), 0)]
    batch = collate(items)  # 3 samples, bound 4: sizes 2 and 6 → 6
    assert tuple(batch["input_ids"].shape) == (6, 4) and batch["samples"] == 3 and batch["real_tokens"] == 6
    assert batch["labels"].tolist() == [1, 2, 0] + [IGNORE_LABEL] * 3
    assert (torch.equal(batch["input_ids"][5], batch["input_ids"][0])
            and torch.equal(batch["attention_mask"][5], batch["attention_mask"][0]))
    assert tuple(collate(items[:2])["input_ids"].shape) == (2, 4)  # already a training size
    assert tuple(collate([(np.arange(1, 8), 0)])["input_ids"].shape) == (3, 8)
    with pytest.raises(ValueError):
        PadCollate(0, [4, 8], "batch-max", rows=[[1], [1]])

"""The task seam (train/tasks/): the step's loss and the held-out figures come from the run's task."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from train.tasks import IGNORE_INDEX, TASKS, CausalLM, Classification, task_for


def test_the_tasks_by_name() -> None:
    assert set(TASKS) == {"classification", "causal-lm"}
    assert isinstance(task_for("classification"), Classification) and isinstance(task_for("causal-lm"), CausalLM)


def test_classification_loss_is_todays_cross_entropy() -> None:
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    assert torch.equal(Classification().loss(logits, labels), F.cross_entropy(logits, labels))


def test_causal_lm_loss_is_the_mean_over_trained_targets_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.tensor([[3, 1, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 6, 2, IGNORE_INDEX]])
    picked = [(0, 0, 3), (0, 1, 1), (1, 1, 6), (1, 2, 2)]
    manual = torch.stack([-F.log_softmax(logits[b, t], -1)[y] for b, t, y in picked]).mean()
    assert torch.allclose(CausalLM().loss(logits, labels), manual, atol=1e-6)


def test_causal_lm_metrics_give_loss_per_target_token_perplexity_and_accuracy() -> None:
    logits = torch.full((1, 3, 4), -10.0)
    logits[0, 0, 2] = 10.0  # right
    logits[0, 1, 1] = 10.0  # wrong (target 3)
    labels = torch.tensor([[2, 3, IGNORE_INDEX]])
    m = CausalLM().metrics(0, torch.device("cpu"))
    m.update(logits, labels, {"samples": 1})
    out = m.result(m.sums())
    expected = (F.cross_entropy(logits[0, :2], labels[0, :2], reduction="sum") / 2).item()
    assert out["loss"] == pytest.approx(expected) and out["perplexity"] == pytest.approx(math.exp(expected))
    assert out["accuracy"] == 0.5 and out["target_tokens"] == 2 and out["samples"] == 1
    empty = CausalLM().metrics(0, torch.device("cpu"))
    assert empty.result(empty.sums()) is None


def test_classification_metrics_match_torchmetrics_and_mean_loss() -> None:
    logits, labels = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0]]), torch.tensor([0, 1, 1])
    m = Classification().metrics(2, torch.device("cpu"))
    m.update(logits, labels, {})
    out = m.result(m.sums())
    assert out["accuracy"] == pytest.approx(2 / 3) and out["samples"] == 3
    assert out["loss"] == pytest.approx(F.cross_entropy(logits, labels).item())


def test_the_built_in_encoder_under_causal_lm_is_refused_in_one_line(wndb, tmp_path) -> None:
    from tests.conftest import assert_clean_error, run_cli, tiny_overrides

    proc = run_cli("train", *tiny_overrides(wndb, tmp_path, "model.task=causal-lm", "train.run_id=lm"))
    assert_clean_error(proc, "model.task=causal-lm needs a decoder", "model.source=hf:llama")
    assert not (tmp_path / "runs" / "lm").exists()  # nothing half-written


def _report(task: str) -> dict:
    quality = {"test_accuracy": 0.25, "test_majority_class_accuracy": 0.1, "test_macro_f1": 0.2,
               "eval_accuracy": 0.3, "test_loss": 2.0, "test_perplexity": math.exp(2.0), "eval_perplexity": 8.5}
    perf = {"throughput_samples_per_s": 10.0, "throughput_tokens_per_s": 1000.0,
            "throughput_target_tokens_per_s": 900.0, "step_time_ms": {"p50": 5.0, "p99": 6.0},
            "time_to_first_step_s": 1.0, "peak_memory_bytes": 2**20, "wall_time_s": 3.0}
    return {"task": task, "quality": quality, "perf": perf, "run_dir": "runs/x",
            "batching": {"token_efficiency": 0.99, "distinct_shapes": 1}}


def test_the_summary_speaks_the_tasks_figures() -> None:
    from train.report.summary import summary_lines

    lm = summary_lines(_report("causal-lm"))
    assert lm[0].startswith("test loss 2.0000 per target token (perplexity 7.39), eval perplexity 8.50")
    assert "majority class" not in lm[0] and "900 trained target tokens/s" in lm[1]
    cls = summary_lines(_report("classification"))
    assert cls[0].startswith("test accuracy 0.2500 (majority class 0.1000)") and "target" not in cls[1]

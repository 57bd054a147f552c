"""A short real run on tiny data: the loss falls and report.json carries every contracted key."""

import json
import time
from pathlib import Path

import torch

from train.compat import load_state
from train.run.training import run_training

REQUIRED = {
    "quality": ["eval_accuracy", "eval_macro_f1", "final_train_loss", "test_accuracy"],
    "data": ["name", "train_samples", "num_classes", "truncated_samples"],
    "batching": ["token_efficiency", "distinct_shapes", "method", "num_buckets", "dropped_samples"],
    "perf": ["throughput_samples_per_s", "throughput_tokens_per_s", "time_to_first_step_s", "step_time_ms",
             "peak_memory_bytes"],
    "env": ["torch", "python", "device", "git_sha", "precision", "precision_reason"],
}


def test_short_run_learns_and_reports(tiny_cfg, precision_branch) -> None:
    """Both ``precision=auto`` branches on a CPU (forced inputs): fp32 by rule without native bf16, bf16 when
    the probe measures it faster; the run learns and reports either way."""
    cfg = tiny_cfg("train.max_steps=60")
    report = run_training(cfg, t_start=time.perf_counter())
    run_dir = Path(report["run_dir"])
    on_disk = json.loads((run_dir / "report.json").read_text())
    for section, keys in REQUIRED.items():
        for key in keys:
            assert key in on_disk[section], f"{section}.{key} missing"
    assert set(on_disk["perf"]["step_time_ms"]) == {"p50", "p90", "p99"}
    assert on_disk["data"]["name"] == "wordnet" and on_disk["data"]["num_classes"] == 45
    assert on_disk["batching"]["distinct_shapes"] <= 3  # static shapes: at most K sequence lengths
    assert 0 < on_disk["batching"]["token_efficiency"] <= 1
    assert on_disk["perf"]["throughput_samples_per_s"] > 0
    assert on_disk["env"]["precision"] == precision_branch["mode"]
    assert on_disk["env"]["precision_source"] == precision_branch["source"]
    assert (on_disk["env"]["precision_measurement"] is not None) == precision_branch["native"]
    assert len(precision_branch["probe_calls"]) == int(precision_branch["native"])  # measured once, when needed
    assert on_disk["perf"]["mfu"] > 0 and on_disk["perf"]["mfu_peak_source"] == "measured matmul"
    assert "energy_j_per_sample" in on_disk["perf"] and "p90" in on_disk["perf"]["step_time_ms"]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert {"step", "loss", "lr", "step_time_ms", "real_tokens", "padded_tokens"} <= set(steps[0])
    assert [r["step"] for r in steps] == list(range(5, 61, 5))
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"], [r["loss"] for r in steps]
    assert on_disk["quality"]["test_accuracy"] > on_disk["quality"]["test_majority_class_accuracy"]

    assert (run_dir / "config.yaml").is_file() and (run_dir / "buckets.json").is_file()
    ckpt = load_state(str(run_dir / "checkpoint.pt"))  # weights_only=True
    assert ckpt["step"] == 60 and isinstance(ckpt["model"]["head.weight"], torch.Tensor)
    assert ckpt["precision"]["mode"] == precision_branch["mode"]  # --resume continues in it


def test_same_seed_same_result(tiny_cfg) -> None:
    a = run_training(tiny_cfg("train.max_steps=8", "train.run_id=a"), time.perf_counter())
    b = run_training(tiny_cfg("train.max_steps=8", "train.run_id=b"), time.perf_counter())
    assert a["quality"]["final_train_loss"] == b["quality"]["final_train_loss"]
    wa = load_state(str(Path(a["run_dir"]) / "checkpoint.pt"))["model"]
    wb = load_state(str(Path(b["run_dir"]) / "checkpoint.pt"))["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_baseline_batching_methods_run(tiny_cfg) -> None:
    pad = run_training(tiny_cfg("train.max_steps=4", "batching.method=pad-to-max", "train.run_id=p"),
                       time.perf_counter())
    assert pad["batching"]["distinct_shapes"] == 1 and pad["batching"]["num_buckets"] is None
    rnd = run_training(tiny_cfg("train.max_steps=4", "batching.method=random", "train.run_id=r"), time.perf_counter())
    assert rnd["batching"]["token_efficiency"] > pad["batching"]["token_efficiency"]
